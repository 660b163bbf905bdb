"""`r3trace serve MODEL --tp 2`: the command line starts two ranks behind one HTTP server, and stops them.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_serve_parallel.py

The server runs in its own session, so every process it started (its ranks) can be found by session id in /proc,
checked gone after the server stops, and killed in `finally` whatever happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from bench.spawn import free_port
from r3trace.trace.reader import open_dataset
from tests.health import wait_healthy
from tests.server.test_cli import ROOT, SAMPLE

pytestmark = pytest.mark.skipif(not (SAMPLE / "config.json").exists(), reason="samples/model is not in this checkout")


def session_pids(sid: int) -> list[int]:
    """Live processes of a session (zombies excluded: they have exited)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def _serve(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "r3trace.cli", "serve", str(SAMPLE), "--port", str(port),
                             "--log-level", "warning", "--max-running-requests", "8", "--kv-pool-tokens", "2048",
                             *flags], stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log


def _wait_gone(sid: int, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.parametrize("stop", ["sigint", "sigkill"])
def test_serve_tp2_answers_and_leaves_no_rank(tmp_path: Path, stop: str) -> None:
    """SIGINT: the graceful path (engine.shutdown), which closes the trace with every request in it. SIGKILL of the
    server: the ranks notice their front end is gone and exit on their own. Neither leaves a folder behind."""
    proc, url, log = _serve(tmp_path, "--tp", "2", "--load-balance-method", "shortest_queue",
                            "--trace-root", str(tmp_path / "traces"), "--trace-dir", "run")
    try:
        wait_healthy(f"{url}/health", proc, 120, lambda: log.read_text()[-3000:])
        assert len(session_pids(proc.pid)) >= 3  # the server, its two ranks (and multiprocessing's resource tracker)
        r = httpx.post(f"{url}/generate", json={"input_ids": [5, 6, 7, 8], "return_routed_experts": True,
                                                "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 4 and r.json()["meta_info"]["routed_experts_shape"][0] == 7
        proc.send_signal(signal.SIGINT if stop == "sigint" else signal.SIGKILL)
        proc.wait(timeout=30)
        assert _wait_gone(proc.pid, 15) == [], log.read_text()[-3000:]
        # the ranks' rendezvous folder (engine/launch/group.py, named for the server's pid) is gone either way:
        # removed by the server's shutdown, or by the ranks once they found the server killed
        assert list(Path(tempfile.gettempdir()).glob(f"r3trace-ranks-{proc.pid}-*")) == []
        if stop == "sigint":  # the graceful stop commits and closes the front end's trace
            [run] = open_dataset(tmp_path / "traces" / "run")
            assert run.state == "closed" and run.manifest.rows == 7 * 4  # 7 computed positions, 4 MoE layers
            assert run.manifest.parallel == {"tp_size": 2, "dp_size": 1, "ep_size": 1}
    finally:
        if session_pids(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_serve_rejects_a_bad_layout_by_name() -> None:
    proc = subprocess.run([sys.executable, "-m", "r3trace.cli", "serve", str(SAMPLE), "--tp", "2", "--dp", "3"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert "dp_size=3 must divide tp_size=2" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_torchrun_two_ranks_serve(tmp_path: Path) -> None:
    """torchrun starts both ranks; world rank 0 hosts the HTTP front end (engine/launch/__main__.py)."""
    port = free_port()
    log = tmp_path / "torchrun.log"
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2",
                             "--log-dir", str(tmp_path / "elastic"), "-m", "r3trace.engine.launch",
                             str(SAMPLE), "--port", str(port), "--log-level", "warning", "--max-running-requests", "8",
                             "--kv-pool-tokens", "2048"], stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/health", proc, 120, lambda: log.read_text()[-3000:])
        body = {"input_ids": [[5, 6, 7, 8], [9, 10]], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        r = httpx.post(f"{url}/generate", json=body)
        assert r.status_code == 200, r.text
        assert [len(o["output_ids"]) for o in r.json()] == [4, 4]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert _wait_gone(proc.pid, 15) == [], log.read_text()[-3000:]
    finally:
        if session_pids(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
