"""SQL with a time limit and a row limit, stoppable by its caller: what a console runs untrusted queries with.

The statement runs as written (never wrapped in `SELECT * FROM (...) LIMIT n`, which a trailing `-- comment`
or a second statement breaks) on its own cursor in a worker thread, and only `max_rows + 1` rows are
fetched from its streaming result: the extra row says whether more exist. The calling thread waits in
slices of `poll_s`, calling `on_wait(elapsed_s)` between them; DuckDB is interrupted when `timeout_s`
passes or when `on_wait` raises (Streamlit raises StopException / RerunException from the next `st` call
once the user presses Stop or leaves the page), so no query outlives the one who asked for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import duckdb
import polars as pl
import pyarrow as pa

# After an interrupt DuckDB returns within milliseconds (measured: 1-20 ms on a three-way cross join);
# past this the worker is left to finish on its own (a daemon thread) rather than hang the caller.
STOP_GRACE_S = 5.0


class QueryTimeout(TimeoutError):
    """A query stopped at its time limit; the message names the limit."""


class LimitedResult(NamedTuple):
    frame: pl.DataFrame  # [<= max_rows, columns]: the statement's first rows
    truncated: bool  # the statement has more rows than max_rows
    seconds: float  # wall time until the rows were fetched


def run_limited(
    con: duckdb.DuckDBPyConnection,
    sql: str,
    *,
    max_rows: int,
    timeout_s: float,
    on_wait: Callable[[float], None] | None = None,
    poll_s: float = 0.1,
) -> LimitedResult:
    """Runs `sql` as written on a new cursor of `con`; returns its first `max_rows` rows.

    Raises QueryTimeout after `timeout_s`, DuckDB's own errors as they are, and whatever `on_wait`
    raises; in every case the query is interrupted and its cursor closed before this returns.
    """
    if max_rows < 1 or timeout_s <= 0:
        raise ValueError(f"max_rows={max_rows} must be >= 1 and timeout_s={timeout_s} > 0")
    cur = con.cursor()
    done = threading.Event()
    box: dict[str, object] = {}

    def work() -> None:
        try:
            box["table"] = _first_rows(cur, sql, max_rows + 1)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    start = time.monotonic()
    worker = threading.Thread(target=work, name="r3trace-sql", daemon=True)
    worker.start()
    timed_out = False
    try:
        while not done.wait(min(poll_s, max(timeout_s - (time.monotonic() - start), 0.0))):
            elapsed = time.monotonic() - start
            if elapsed >= timeout_s:
                timed_out = True
                break
            if on_wait is not None:
                on_wait(elapsed)
    finally:
        _stop(cur, done)
    seconds = time.monotonic() - start
    if timed_out:
        raise QueryTimeout(f"query stopped after {seconds:.1f} s: the time limit is {timeout_s:g} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    table = box["table"]
    assert isinstance(table, pa.Table)
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)  # from_arrow of a Table is always a DataFrame
    return LimitedResult(frame.head(max_rows), frame.height > max_rows, seconds)


def _first_rows(cur: duckdb.DuckDBPyConnection, sql: str, n: int) -> pa.Table:
    """The first n rows of the last statement in `sql`, read from its stream (the rest is never computed
    where the plan streams: a cross join yields its first rows at once)."""
    rel = cur.sql(sql)
    if rel is None:  # a statement without a result (the read-only store refuses those before this)
        return pa.table({})
    reader = rel.to_arrow_reader(min(n, 65_536))
    batches, rows = [], 0
    for batch in reader:
        batches.append(batch)
        rows += batch.num_rows
        if rows >= n:
            break
    table = pa.Table.from_batches(batches, schema=reader.schema).slice(0, n)
    return table.rename_columns(_unique_names(table.column_names))


def _unique_names(names: list[str]) -> list[str]:
    """`SELECT * FROM a, b` repeats column names; a DataFrame cannot: later copies become `name_1`, ..."""
    seen: set[str] = set()
    out = []
    for name in names:
        new, i = name, 0
        while new in seen:
            i += 1
            new = f"{name}_{i}"
        seen.add(new)
        out.append(new)
    return out


def _stop(cur: duckdb.DuckDBPyConnection, done: threading.Event) -> None:
    """Interrupts until the worker has left DuckDB (an interrupt sent just before the query starts is
    lost, so it is repeated), then closes the cursor."""
    deadline = time.monotonic() + STOP_GRACE_S
    while not done.wait(0.02):
        cur.interrupt()
        if time.monotonic() > deadline:
            return  # the daemon worker still holds the cursor: closing it under a running query is unsafe
    cur.close()
