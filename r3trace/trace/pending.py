"""Pending: what a TraceWriter holds between commits; Inbox: the lock that guards it, the hand-over through
which the writer's flusher thread takes it, and the back-pressure that keeps that thread from starving.

Rows are kept as appended (a routes table, or append_tokens' checked per-token batch) with their row count;
finished requests as requests-table rows; `open` is the requests with rows and no requests-table row yet, in
first-seen order (what the manifest's `open_requests` lists after a commit).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, TypeAlias

import pyarrow as pa

Batch: TypeAlias = "pa.Table | dict[str, Any]"  # rows as a table (append), or append_tokens' checked arguments
# one commit's (batch, rows) pairs, finished requests, open request ids
Taken: TypeAlias = "tuple[list[tuple[Batch, int]], list[dict[str, Any]], tuple[str, ...]]"


class Pending:
    def __init__(self) -> None:
        self.rows: list[tuple[Batch, int]] = []
        self.n_rows = 0
        self.requests: list[dict[str, Any]] = []
        self.open: dict[str, None] = {}
        self.oldest: float | None = None  # monotonic time of the oldest uncommitted item

    def add_rows(self, batch: Batch, n_rows: int, rids: list[str]) -> bool:
        """True when this is the first uncommitted item (the flusher then has a deadline to set)."""
        self.rows.append((batch, n_rows))
        self.n_rows += n_rows
        for rid in rids:
            self.open[rid] = None
        return self._started()

    def add_request(self, row: dict[str, Any]) -> bool:
        self.requests.append(row)
        self.open.pop(row["request_id"], None)
        return self._started()

    def mark_unfinished(self, run_id: str) -> None:
        """Every open request gets a requests-table row with finish_reason "unfinished"."""
        for rid in list(self.open):
            self.requests.append(dict(run_id=run_id, request_id=rid, finish_reason="unfinished"))
        self.open.clear()

    def _started(self) -> bool:
        if self.oldest is None:
            self.oldest = time.monotonic()
            return True
        return False

    def due_in(self, rows_per_file: int, flush_interval_s: float | None) -> float | None:
        """Seconds until the next commit is due (<= 0: now); None: nothing waits. A request is committed within
        flush_interval_s / 2 plus one commit's write of finishing, so a kill loses at most flush_interval_s."""
        if self.n_rows >= rows_per_file:
            return 0.0
        if self.oldest is None or flush_interval_s is None:
            return None
        return self.oldest + flush_interval_s / 2 - time.monotonic()

    def take(self) -> Taken:
        taken = (self.rows, self.requests, tuple(self.open))
        self.rows, self.n_rows, self.requests, self.oldest = [], 0, [], None
        return taken

    def put_back(self, taken: Taken) -> None:
        """A commit that failed: its rows and requests go back in front, due again from now."""
        rows, requests, _ = taken
        self.rows = rows + self.rows
        self.n_rows += sum(n for _, n in rows)
        self.requests = requests + self.requests
        if rows or requests:
            self.oldest = time.monotonic()


class Inbox:
    """A Pending under one lock, between the callers that add to it (any thread) and the flusher that takes it.

    A caller appending in a tight loop re-takes the (unfair) lock within one GIL slice, so a flusher blocked on it
    starves (seen: no commit in 3 s at 180K appends/s). So when a commit is due the flusher raises `_want`, and the
    next caller takes the buffers for it, under the lock it holds anyway, and hands them over; with no caller
    around, the flusher takes them itself after 10 ms.

    The GIL starves the flusher the same way: CPython's waiting thread asks the holder to drop the GIL only after
    5 ms in which nobody else took it, and a caller whose numpy or torch calls release and re-take it every few
    microseconds resets that clock each time, so the flusher runs only when it wins a race (seen: a 2 ms table
    build took 1.9 s of wall time, and no commit landed in 3 s, beside a caller looping over append_tokens). So
    a caller that finds the due commit more than flush_interval_s / 4 late waits, off the GIL, until a commit
    lands (at most flush_interval_s, then not again until one lands): back-pressure only when the flusher
    starves; the bound of writer.py (a request committed within flush_interval_s of finishing) then holds."""

    def __init__(self, rows_per_file: int, flush_interval_s: float | None) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Event()  # set when the flusher has something new to consider
        self.pending = Pending()  # guarded by lock
        self.rows_per_file = rows_per_file
        self.flush_interval_s = flush_interval_s
        self._want = False
        self._handoff: queue.SimpleQueue[Taken] = queue.SimpleQueue()
        self._landed = threading.Condition(threading.Lock())  # notified when a commit ends
        self.commits_landed = 0  # commits ended (or failed), written under _landed
        self._inflight_due: float | None = None  # monotonic due time of what the flusher took and has not committed
        self._gave_up_at = -1  # commits_landed when a wait last timed out: no more waits until a commit lands
        self.stalled_s = 0.0  # callers' time spent waiting for a starved flusher

    # ---------------------------------------------------------------- callers, holding `lock`
    def add_rows(self, batch: Batch, n_rows: int, rids: list[str]) -> None:
        if self.pending.add_rows(batch, n_rows, rids) or self.pending.n_rows >= self.rows_per_file:
            self.wake.set()  # the flusher sleeps without a deadline while nothing waits
        self._hand_over()

    def add_request(self, row: dict[str, Any]) -> None:
        if self.pending.add_request(row):
            self.wake.set()
        self._hand_over()

    def overdue(self) -> int | None:
        """(Holding `lock`) commits_landed to wait past when the oldest item not yet committed, in the flusher's
        hands or still here, is more than flush_interval_s / 4 past its due time; None: no need to wait."""
        if self.flush_interval_s is None or self._gave_up_at == self.commits_landed:
            return None
        due = self._inflight_due
        if self.pending.oldest is not None:
            mine = self.pending.oldest + self.flush_interval_s / 2
            due = mine if due is None else min(due, mine)
        if due is None or time.monotonic() - due <= self.flush_interval_s / 4:
            return None
        return self.commits_landed

    def wait_landed(self, seen: int) -> None:
        """(Not holding `lock`) block, without the GIL, until a commit after `seen` lands (at most
        flush_interval_s)."""
        assert self.flush_interval_s is not None  # overdue() said so
        t0 = time.monotonic()
        with self._landed:
            if not self._landed.wait_for(lambda: self.commits_landed != seen, timeout=self.flush_interval_s):
                self._gave_up_at = seen
            self.stalled_s += time.monotonic() - t0

    def landed(self, flusher: bool) -> None:
        """A commit ended, committed or failed and put back: release the callers waiting on it. flusher: the
        flusher's own commit, whose due time overdue() counted; a flush() or close() from another thread took only
        what was not in the flusher's hands, so the flusher's due time stays until its commit ends."""
        with self._landed:
            if flusher:
                self._inflight_due = None
            self.commits_landed += 1
            self._landed.notify_all()

    def take_all(self) -> Taken:
        """Everything not committed, what was handed over to the flusher included (flush and close)."""
        while not self._handoff.empty():
            self.pending.put_back(self._handoff.get())
        return self.pending.take()

    def _hand_over(self) -> None:
        """The flusher asked for the buffers."""
        if self._want:
            self._want = False
            self._handoff.put(self._take())

    def _take(self) -> Taken:
        """(Holding `lock`) the buffers for the flusher, remembering when they were due."""
        if self.pending.oldest is not None and self.flush_interval_s is not None:
            self._inflight_due = self.pending.oldest + self.flush_interval_s / 2
        return self.pending.take()

    # ---------------------------------------------------------------- the flusher thread, not holding `lock`
    def take_for_flusher(self) -> Taken:
        """The buffers for a commit that is due: from the next caller, or taken here after 10 ms without one."""
        self._want = True
        try:
            return self._handoff.get(timeout=0.01)
        except queue.Empty:
            with self.lock:
                mine = self._want  # still set: no caller came by, take the buffers here
                self._want = False
                own = self._take() if mine else None
            return own if own is not None else self._handoff.get()  # else a caller took them meanwhile
