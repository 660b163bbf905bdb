"""Progress bars on stderr, one switch for every long command: `r3trace --progress auto|on|off`.

Library functions take `progress: bool | None`: True always shows the bar, False never, None only when
stderr is a terminal (tqdm's `disable=None`), so logs and pipes stay clean unless a bar is asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, Protocol

from tqdm import tqdm

ProgressMode = Literal["auto", "on", "off"]
PROGRESS_MODES: tuple[ProgressMode, ...] = ("auto", "on", "off")


def progress_flag(mode: str) -> bool | None:
    """`--progress` value -> the `progress` argument of library functions."""
    return {"auto": None, "on": True, "off": False}[mode]


def progress_bar(progress: bool | None, **kw: Any) -> tqdm:
    """A tqdm bar on stderr (tqdm's default file), shown as `progress` says (module docstring)."""
    return tqdm(disable=None if progress is None else not progress, **kw)


class QueryProgress(Protocol):
    """What the poller needs of a DuckDB cursor."""

    def execute(self, query: str) -> object: ...
    def query_progress(self) -> float: ...


@contextmanager
def duckdb_progress(cursor: QueryProgress, progress: bool | None, desc: str) -> Iterator[None]:
    """A percent bar for the query run on `cursor` inside the block: DuckDB's own estimate of the rows
    processed, polled every 0.1 s from a thread (the query releases the GIL while it runs)."""
    bar = progress_bar(progress, total=100, desc=desc, bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}]")
    if bar.disable:  # tqdm's disabled bar is inert: nothing to close
        yield
        return
    cursor.execute("SET enable_progress_bar = true")  # tracks progress; the next line keeps DuckDB from printing it
    cursor.execute("SET enable_progress_bar_print = false")
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.1):
            done = cursor.query_progress()  # -1 while no query runs
            if done > bar.n:
                bar.update(done - bar.n)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield
        stop.set()
        poller.join()
        bar.update(100 - bar.n)  # the query returned: all of it is done
    finally:
        stop.set()
        bar.close()
