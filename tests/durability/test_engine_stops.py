"""Every stop of a tracing engine, in a real child process on the tiny V3 checkpoint: what reaches disk.

- the README's snippet (start_trace, generate, exit without stop_trace) commits every row;
- SIGTERM and SIGINT while requests run: every finished request committed, the run closed, the requests
  cut off marked (abort or unfinished), never rows without a request row;
- SIGKILL: every request that finished more than flush_interval_s before the kill is committed, whole.
Row values are compared with what each request returned (return_routed_experts), not only counted.
Run: .venv/bin/pytest tests/durability/test_engine_stops.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from r3trace.analysis.store import TraceStore
from r3trace.capture.wire import decode_routed_experts
from r3trace.trace import Manifest, open_dataset
from tests.durability.kill_harness import REPO

CHILD = textwrap.dedent("""
    import json, os, sys, time
    from r3trace.engine import Engine
    ckpt, trace, log_path, n_max = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    engine = Engine(ckpt)
    engine.start_trace(trace, run_id="r", flush_interval_s=0.5)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(log, b"ready\\n")
    i = 0
    while n_max < 0 or i < n_max:
        prompts = [[(i * 7 + 3 * b + j) % 300 + 2 for j in range(5 + (i + b) % 9)] for b in range(3)]
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0,
                               "ignore_eos": True}, return_routed_experts=True)
        for out in outs:
            meta = out["meta_info"]
            line = {"rid": meta["id"], "t": time.time(), "routes": meta["routed_experts"],
                    "shape": meta["routed_experts_shape"]}
            os.write(log, (json.dumps(line) + "\\n").encode())
        i += 1
""")


def _start(tiny_ckpt: Path, tmp: Path, n_max: int) -> tuple[subprocess.Popen[bytes], Path, Path]:
    log = tmp / "log.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tiny_ckpt), str(tmp / "trace"), str(log), str(n_max)],
                            env=env, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (log.exists() and log.read_bytes().startswith(b"ready")):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)
    return proc, log, tmp / "trace"


def _finished(log: Path) -> dict[str, tuple[float, np.ndarray]]:
    out = {}
    for line in log.read_text().splitlines()[1:]:
        d = json.loads(line)
        ids = decode_routed_experts({"routed_experts": d["routes"], "routed_experts_shape": d["shape"]})
        out[d["rid"]] = (d["t"], ids)
    return out


def _check(trace: Path, finished: dict[str, tuple[float, np.ndarray]], horizon: float) -> dict[str, str]:
    """Committed requests' rows equal the returned routes; no rows without a request row. Returns reasons."""
    run = open_dataset(trace)[0]
    store = TraceStore(trace)
    reasons = dict(store.query("SELECT request_id, finish_reason FROM requests").rows())
    moe = list(run.manifest.moe_layer_ids)
    for rid, (t, ids) in finished.items():
        if t > horizon:
            continue
        assert reasons.get(rid) in ("length",), f"{rid} finished at {t:.2f} (horizon {horizon:.2f}): {reasons.get(rid)}"
        got = store.query("SELECT token_pos, topk_ids FROM routes WHERE request_id = ? ORDER BY token_pos, layer_id",
                          [rid])
        arr = np.array(got["topk_ids"].to_list(), np.int32).reshape(-1, len(moe), ids.shape[-1])
        np.testing.assert_array_equal(arr, ids[:, moe], err_msg=rid)
    with_rows = set(store.query("SELECT DISTINCT request_id FROM routes")["request_id"].to_list())
    assert with_rows <= set(reasons), f"rows without a request row: {sorted(with_rows - set(reasons))[:3]}"
    return reasons


def test_exit_without_stop_trace_commits_everything(tiny_ckpt: Path, tmp_path: Path) -> None:
    proc, log, trace = _start(tiny_ckpt, tmp_path, n_max=2)
    assert proc.wait(timeout=120) == 0
    finished = _finished(log)
    assert len(finished) == 6
    m = Manifest.read(trace / "run_id=r")
    assert m.status == "closed"
    reasons = _check(trace, finished, horizon=time.time())
    assert set(reasons) == set(finished)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_signal_commits_every_finished_request(tiny_ckpt: Path, tmp_path: Path, sig: int) -> None:
    proc, log, trace = _start(tiny_ckpt, tmp_path, n_max=-1)
    time.sleep(1.5)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    finished = _finished(log)
    assert finished, err.decode()
    assert Manifest.read(trace / "run_id=r").status == "closed"
    reasons = _check(trace, finished, horizon=time.time())
    cut = {r for r, why in reasons.items() if why != "length"}
    assert cut <= {r for r, why in reasons.items() if why in ("abort", "unfinished")}


def test_sigkill_loses_at_most_the_last_flush_interval(tiny_ckpt: Path, tmp_path: Path) -> None:
    proc, log, trace = _start(tiny_ckpt, tmp_path, n_max=-1)
    time.sleep(2.0)
    killed_at = time.time()
    proc.kill()
    proc.wait()
    finished = _finished(log)
    run = open_dataset(trace)[0]
    assert run.state == "crashed"
    old = [r for r, (t, _) in finished.items() if t <= killed_at - 0.5]
    assert old, "nothing finished long enough before the kill to test the bound"
    _check(trace, finished, horizon=killed_at - 0.5)  # flush_interval_s=0.5 in the child
