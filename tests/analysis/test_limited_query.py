"""run_limited on a real read-only store: SQL as written, a row limit without rewriting, a time limit and a
caller's stop that both interrupt DuckDB and leave the CPU idle.
Run: .venv/bin/pytest tests/analysis/test_limited_query.py -q"""

from __future__ import annotations

import resource
import time

import duckdb
import pytest

from r3trace.analysis.limited_query import QueryTimeout, run_limited
from r3trace.analysis.store import TraceStore

# 720 route rows: a three-way join (3.7e8 rows) counts in under a second, a four-way one (2.7e11) takes hours
RUNAWAY = "SELECT count(*) FROM routes a, routes b, routes c, routes d"


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def idle_cpu_s(window_s: float = 0.5) -> float:
    """CPU this process burns in `window_s` of sleep: ~0 once DuckDB's threads have stopped."""
    before = cpu_s()
    time.sleep(window_s)
    return cpu_s() - before


@pytest.fixture()
def store(tiny_trace: dict) -> TraceStore:
    return TraceStore(tiny_trace["root"], read_only=True)


def test_sql_runs_as_written_with_a_row_limit(store: TraceStore, tiny_trace: dict) -> None:
    t = len(tiny_trace["ids"])
    got = run_limited(store.con, "SELECT count(*) AS n FROM tokens -- every token", max_rows=10, timeout_s=10)
    assert got.frame["n"].to_list() == [t] and not got.truncated
    got = run_limited(store.con, "SELECT 1 AS a; SELECT 2 AS b;", max_rows=10, timeout_s=10)  # the last one's rows
    assert got.frame.columns == ["b"] and got.frame["b"].to_list() == [2]
    got = run_limited(store.con, "SELECT token_pos FROM tokens ORDER BY token_pos DESC -- newest first",
                      max_rows=7, timeout_s=10)
    assert got.frame.height == 7 and got.truncated
    assert got.frame["token_pos"].to_list() == sorted(tiny_trace["pos"].tolist(), reverse=True)[:7]
    exact = run_limited(store.con, f"SELECT * FROM range({t})", max_rows=t, timeout_s=10)
    assert exact.frame.height == t and not exact.truncated


def test_a_streaming_runaway_returns_its_first_rows_at_once(store: TraceStore) -> None:
    got = run_limited(store.con, "SELECT * FROM routes a, routes b, routes c", max_rows=100, timeout_s=10)
    assert got.frame.height == 100 and got.truncated and got.seconds < 5
    assert got.frame.columns[:2] == ["run_id", "request_id"] and "run_id_2" in got.frame.columns


def test_errors_come_back_as_duckdb_errors(store: TraceStore) -> None:
    with pytest.raises(duckdb.BinderException, match="no_such_column"):
        run_limited(store.con, "SELECT no_such_column FROM routes", max_rows=1, timeout_s=10)


def test_time_limit_interrupts_duckdb(store: TraceStore) -> None:
    start = time.monotonic()
    with pytest.raises(QueryTimeout, match="time limit is 1 s"):
        run_limited(store.con, RUNAWAY, max_rows=1, timeout_s=1.0)
    assert time.monotonic() - start < 2.0
    assert idle_cpu_s() < 0.1
    assert run_limited(store.con, "SELECT 42 AS x", max_rows=1, timeout_s=5).frame["x"].item() == 42


class Stopped(BaseException):
    """What Streamlit's StopException is to run_limited: a BaseException raised from on_wait."""


def test_a_stop_raised_by_the_caller_interrupts_duckdb(store: TraceStore) -> None:
    stop_at = 0.5

    def on_wait(elapsed: float) -> None:
        if elapsed > stop_at:
            raise Stopped

    start = time.monotonic()
    with pytest.raises(Stopped):
        run_limited(store.con, RUNAWAY, max_rows=1, timeout_s=60, on_wait=on_wait)
    assert time.monotonic() - start < stop_at + 1.0
    assert idle_cpu_s() < 0.1
