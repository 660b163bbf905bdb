"""TraceWriter's back-pressure (pending.Inbox): a caller whose numpy calls keep releasing and re-taking the GIL
must not starve the flusher past the durability bound, and nobody waits when the flusher keeps up or the disk fails.

In-process: the caller is this thread, appending the way the engine's capturer does (append_tokens per forward
for a few requests at once, add_request when one ends). Run: .venv/bin/pytest tests/trace/test_writer_backpressure.py -q
"""

from __future__ import annotations

import time
from pathlib import Path

import duckdb
import numpy as np
import pytest

from r3trace.trace import TraceWriter, open_dataset
from r3trace.trace.pending import Inbox

MOE, E, K = (1, 2, 3), 16, 2


def _writer(root: Path, interval: float) -> TraceWriter:
    return TraceWriter(root, model_name="t", num_hidden_layers=4, moe_layer_ids=MOE, num_experts=E, top_k=K,
                       run_id="b", flush_interval_s=interval, fsync=False)


def _record(w: TraceWriter, seconds: float, step_s: float, seed: int) -> dict[str, float]:
    """Requests of 1..37 tokens, 6 in flight, 1-5 tokens each per forward; returns finish time (monotonic) per id."""
    rng = np.random.default_rng(seed)
    live: list[list[int]] = []
    finished: dict[str, float] = {}
    nxt = fwd = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        while len(live) < 6:
            live.append([nxt, int(rng.integers(1, 38)), 0])
            nxt += 1
        for req in list(live):
            i, n, done = req
            step = min(n - done, int(rng.integers(1, 6)))
            ids = (rng.integers(0, E, size=(step, len(MOE), 1)) + np.arange(K)) % E
            w.append_tokens(f"r{i}", np.arange(done, done + step), "decode", "computed", fwd, time.time_ns(), 0, ids)
            req[2] += step
            if req[2] == n:
                w.add_request(f"r{i}", prompt_tokens=n, completion_tokens=0, finish_reason="length")
                finished[f"r{i}"] = time.monotonic()
                live.remove(req)
        fwd += 1
        if step_s:
            time.sleep(step_s)
    return finished


def _committed(root: Path) -> set[str]:
    run = open_dataset(root)[0]
    files = [str(p) for p in run.request_files]
    return {r for (r,) in duckdb.sql(f"SELECT request_id FROM read_parquet({files})").fetchall()} if files else set()


def test_a_busy_caller_does_not_starve_the_flusher(tmp_path: Path) -> None:
    """Without back-pressure no commit landed in 3 s of this loop (the flusher lost every race for the GIL)."""
    interval = 0.4
    w = _writer(tmp_path, interval)
    finished = _record(w, seconds=2.0, step_s=0.0, seed=0)
    stopped = time.monotonic()
    committed = _committed(tmp_path)  # what a kill -9 now would leave
    w.close()
    must = {rid for rid, t in finished.items() if t <= stopped - interval}
    assert len(must) > 100, len(must)
    lost = sorted(must - committed)
    assert not lost, f"{len(lost)} of {len(must)} requests finished > {interval} s ago are not committed"
    assert _committed(tmp_path) >= set(finished)


def test_no_back_pressure_while_the_flusher_keeps_up(tmp_path: Path) -> None:
    """A caller that sleeps between forwards (the engine waits for its GPU) leaves the flusher the GIL."""
    w = _writer(tmp_path, 0.4)
    finished = _record(w, seconds=1.5, step_s=0.005, seed=1)
    st = w.status()
    w.close()
    assert st.commits >= 2 and st.stalled_s == 0.0, st
    assert _committed(tmp_path) >= set(finished)


def test_no_back_pressure_while_commits_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing disk is not a starved flusher: the caller runs on, the rows are kept and land once it heals."""
    w = _writer(tmp_path, 0.2)

    def full_disk(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(w._committer, "commit", full_disk)
    t0 = time.monotonic()
    finished = _record(w, seconds=1.0, step_s=0.0, seed=2)
    took = time.monotonic() - t0
    st = w.status()
    assert st.last_error is not None and "No space" in st.last_error and st.commits == 0
    # the first commit may be waited for (it was due, and its failure not known yet); after it, nobody waits. took:
    # 1 s of recording; a caller held for each failing commit would wait ~0.2 s for each of the 5 (> 2 s); with four
    # processes on two cores it took 1.55 s and stalled 0.011 s
    assert st.stalled_s < 0.1 and took < 1.8, (st, took)
    monkeypatch.undo()
    w.close()
    assert _committed(tmp_path) >= set(finished)


def test_a_flush_from_another_thread_keeps_the_flushers_due_time() -> None:
    # the flusher took a request and has not committed it; a flush() or close() commits only what was left, so its
    # landing must not clear the flusher's due time (callers would stop waiting on a starved flusher)
    inbox = Inbox(rows_per_file=1000, flush_interval_s=0.08)
    with inbox.lock:
        inbox.add_request({"request_id": "a"})
    taken = inbox.take_for_flusher()  # no caller comes by: taken here after 10 ms
    assert taken[1] == [{"request_id": "a"}]
    time.sleep(0.1)  # past its due time (0.04 s after it arrived) by more than a quarter interval
    with inbox.lock:
        assert inbox.overdue() == 0
    inbox.landed(flusher=False)  # another thread's flush
    with inbox.lock:
        assert inbox.overdue() == 1  # the flusher's commit is still overdue: callers wait past commit 1
    inbox.landed(flusher=True)
    with inbox.lock:
        assert inbox.overdue() is None
