"""`r3trace serve --trace-dir` as a real process on the bundled sample model: the trace it started is the
one /stop_trace stops; /start_trace takes the flush settings; /metrics and /trace_status report the state;
SIGTERM and SIGINT commit and close whatever trace records, with every request's rows.
Run: .venv/bin/pytest tests/durability/test_serve_trace.py -q
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.spawn import free_port
from r3trace.trace import open_dataset
from tests.durability.kill_harness import REPO
from tests.health import wait_healthy

SAMPLE = REPO / "samples" / "model"
GEN = {"text": "def fib(n):", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


def _serve(tmp: Path, *extra: str) -> tuple[subprocess.Popen[bytes], httpx.Client]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "r3trace.cli", "serve", str(SAMPLE), "--port", str(port),
                             "--trace-root", str(tmp / "traces"), "--log-level", "warning", *extra],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(f"{url}/health", proc, 120, lambda: proc.stderr.read().decode() if proc.stderr else "")
    return proc, httpx.Client(base_url=url, timeout=60)


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"r3trace_{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"r3trace_{name} not in /metrics")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_trace_over_http_and_graceful_stop(tmp_path: Path, sig: int) -> None:
    proc, client = _serve(tmp_path, "--trace-dir", "first")
    try:
        assert client.get("/trace_status").json()["tracing"] is True
        for _ in range(2):
            out = client.post("/generate", json=GEN)
            assert out.status_code == 200
        rows = (out.json()["meta_info"]["prompt_tokens"] + 6 - 1) * 4  # per request: positions x 4 MoE layers
        busy = client.post("/start_trace", json={"trace_dir": "other"})
        assert busy.status_code == 409 and "already tracing" in busy.text
        stopped = client.post("/stop_trace")
        assert stopped.status_code == 200, stopped.text
        assert stopped.json()["rows_durable"] == 2 * rows
        assert client.post("/stop_trace").status_code == 409
        bad = client.post("/start_trace", json={"trace_dir": "second", "flush_interval_s": 0})
        assert bad.status_code == 400 and "flush_interval_s" in bad.text
        started = client.post("/start_trace", json={"trace_dir": "second", "flush_interval_s": 0.3,
                                                    "rows_per_file": 4096, "fsync": False})
        assert started.status_code == 200, started.text
        assert client.post("/generate", json=GEN).status_code == 200
        time.sleep(0.8)  # > flush_interval_s: the finished request is committed without any stop
        assert _metric(client, "trace_recording") == 1
        assert _metric(client, "trace_rows_durable") == rows
        assert _metric(client, "trace_requests_durable") == 1
        assert _metric(client, "trace_rows_buffered") == 0
        assert 0 <= _metric(client, "trace_last_flush_age_seconds") < 5
        assert _metric(client, "trace_stalled_seconds_total") == 0  # one request at a time never starves the flusher
        assert client.post("/generate", json=GEN).status_code == 200  # committed only by the stop below
    finally:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    runs = {r.run_dir.parent.name: r for r in open_dataset([tmp_path / "traces" / "first",
                                                            tmp_path / "traces" / "second"])}
    assert {n: r.state for n, r in runs.items()} == {"first": "closed", "second": "closed"}, err.decode()
    second = runs["second"].manifest
    assert second.rows == 2 * rows and second.flush_interval_s == 0.3 and second.fsync is False
