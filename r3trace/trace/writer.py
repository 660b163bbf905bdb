"""TraceWriter: the sink side of the trace contract (schema.py), one run per writer.

Durability contract (docs/durability.md):
- Callers hand rows (`append`, any thread) and finished requests (`add_request`) to memory; a flusher thread
  group-commits them (commit.py): once the oldest uncommitted item is `flush_interval_s / 2` old, and at once
  when `rows_per_file` rows are waiting. A request is committed with its rows no later than
  flush_interval_s / 2 + one commit's write after it finished, so a kill -9 loses at most the requests that
  finished in the last `flush_interval_s` (default 1 s), whatever the file size. A caller that finds that commit
  a quarter interval late waits for it (pending.Inbox: the GIL can starve the flusher).
- Every normal end commits everything and marks the run closed: `close()`, the interpreter's exit, SIGTERM and
  SIGINT (lifecycle.py), and the engine's stop_trace / shutdown.
- A reader never sees a partial file, and a request's row in the requests table is committed with or after
  all of its route rows. Requests with committed rows and no requests-table row yet are listed in the
  manifest's `open_requests`; after a crash, readers report them as unfinished (reader.py).
- fsync (default on): each file and the run folder before the manifest names them, then the manifest.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from r3trace.trace import lifecycle
from r3trace.trace.batch import Labels, route_rows
from r3trace.trace.commit import RunCommitter, now_iso, route_files
from r3trace.trace.pending import Batch, Inbox, Taken
from r3trace.trace.placements import placement_table
from r3trace.trace.schema import ROW_GROUP_ROWS, Manifest, TraceSchemaError, route_schema, run_dir_name
from r3trace.trace.status import WriterStatus
from r3trace.trace.tokens import check_tokens, distinct

log = logging.getLogger("r3trace.trace")
MAX_FLUSH_INTERVAL_S = 3600.0


class TraceWriter:
    """Writes one run: `<root>/run_id=<id>/manifest.json` and the files it lists in `<root>/routes/run_id=<id>/`,
    `rollups/` and `requests/` (layout.py). append/add_request are thread-safe."""

    def __init__(
        self,
        root: str | Path,
        *,
        model_name: str,
        num_hidden_layers: int,
        moe_layer_ids: Sequence[int],
        num_experts: int,
        top_k: int,
        run_id: str | None = None,
        with_weights: bool = False,
        with_physical_ids: bool = False,
        num_groups: int = 1,
        config_hash: str = "",
        engine: dict[str, Any] | None = None,
        parallel: dict[str, Any] | None = None,
        rows_per_file: int = 8 * ROW_GROUP_ROWS,
        flush_interval_s: float | None = 1.0,
        fsync: bool = True,
        rollup_window_s: float = 1.0,
        small_file_rows: int = ROW_GROUP_ROWS,
        compact_fanin: int = 8,
    ) -> None:
        run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
        if flush_interval_s is not None and not 0 < flush_interval_s <= MAX_FLUSH_INTERVAL_S:
            raise TraceSchemaError(f"flush_interval_s={flush_interval_s} must be in (0, {MAX_FLUSH_INTERVAL_S:g}]"
                                   " seconds, or None for commits on size and close only")
        if compact_fanin < 2:
            raise TraceSchemaError(f"compact_fanin={compact_fanin} must be >= 2")
        self.manifest = Manifest(
            run_id=run_id, model_name=model_name, num_hidden_layers=num_hidden_layers,
            moe_layer_ids=tuple(int(x) for x in moe_layer_ids), num_experts=num_experts, top_k=top_k,
            with_weights=with_weights, with_physical_ids=with_physical_ids, num_groups=num_groups,
            config_hash=config_hash,
            engine=dict(engine or {}), parallel=dict(parallel or {}), start_time=now_iso(),
            rollup_window_ns=int(rollup_window_s * 1e9), status="recording", flush_interval_s=flush_interval_s,
            fsync=fsync,
        )
        if rows_per_file < len(self.manifest.moe_layer_ids):
            raise TraceSchemaError(
                f"rows_per_file={rows_per_file} must hold one token ({len(self.manifest.moe_layer_ids)} rows)"
            )
        self.run_dir = Path(root) / run_dir_name(run_id)
        if (self.run_dir / "manifest.json").exists():
            raise TraceSchemaError(f"run_id={run_id!r} already exists under {root}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._run_lock = lifecycle.hold_run_lock(self.run_dir)  # released by the kernel if this process dies
        self.rows_per_file = rows_per_file
        self.flush_interval_s = flush_interval_s
        self.schema = route_schema(top_k, with_weights, with_physical_ids)
        self._layer_ok = np.zeros(num_hidden_layers, dtype=bool)
        self._layer_ok[list(self.manifest.moe_layer_ids)] = True
        self.manifest.write(self.run_dir)
        self._committer = RunCommitter(self.run_dir, self.manifest, self.schema, fsync=fsync,
                                       small_rows=small_file_rows, fanin=compact_fanin, max_rows=rows_per_file)
        self._inbox = Inbox(rows_per_file, flush_interval_s)  # its lock also guards _error, _closing and _closed
        self._lock, self._wake = self._inbox.lock, self._inbox.wake
        self._committing = threading.Lock()  # one commit at a time: the flusher's, flush()'s or close()'s
        self._error: BaseException | None = None
        self._closing = False
        self._closed = False
        self._flusher = threading.Thread(target=self._flush_loop, name=f"r3trace-trace-{run_id}", daemon=True)
        self._flusher.start()
        lifecycle.register_writer(self)

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- callers (any thread)
    def append_tokens(
        self, request_id: Labels, token_pos: Any, phase: Labels, source: Labels, forward_id: Any, ts: Any,
        dp_rank: Any, topk_ids: np.ndarray, topk_weights: np.ndarray | None = None,
        physical_ids: np.ndarray | None = None,
    ) -> None:
        """T tokens: per-token columns [T] (or scalars), topk_ids [T, L, K] over the manifest's MoE layers;
        topk_weights and physical_ids [T, L, K], required when the manifest says with_weights / with_physical_ids
        (and ignored otherwise).

        Validated here, per token; expanded to T * L rows and built into Arrow by the flusher thread, so the caller
        (the engine's scheduler thread, once per forward) pays a few numpy passes, not the table build."""
        m = self.manifest
        kw = check_tokens(m.moe_layer_ids, m.num_experts, m.top_k, m.with_weights, request_id, token_pos, phase,
                          source, forward_id, ts, dp_rank, topk_ids, topk_weights, m.with_physical_ids, physical_ids)
        self._stash(kw, len(kw["topk_ids"]) * m.num_moe_layers, distinct(request_id))

    def append(
        self, request_id: Labels, token_pos: Any, phase: Labels, source: Labels, forward_id: Any, ts: Any,
        dp_rank: Any, layer_id: Any, topk_ids: np.ndarray, topk_weights: np.ndarray | None = None,
        physical_ids: np.ndarray | None = None,
    ) -> None:
        """N rows, token-major, one entry per row; topk_ids [N, K]. Validated before anything is buffered."""
        self._append(dict(request_id=request_id, token_pos=token_pos, phase=phase, source=source,
                          forward_id=forward_id, ts=ts, dp_rank=dp_rank, layer_id=layer_id, topk_ids=topk_ids,
                          topk_weights=topk_weights, physical_ids=physical_ids), distinct(request_id))

    def _append(self, kw: dict[str, Any], rids: list[str]) -> None:
        m = self.manifest
        table = route_rows(m.run_id, num_experts=m.num_experts, top_k=m.top_k, with_weights=m.with_weights,
                           with_physical_ids=m.with_physical_ids, **kw)
        lid = table.column("layer_id").to_numpy()
        bad = (lid < 0) | (lid >= len(self._layer_ok))
        if bad.any() or not self._layer_ok[lid].all():
            value = int(lid[bad][0]) if bad.any() else int(lid[~self._layer_ok[lid]][0])
            raise TraceSchemaError(f"column layer_id holds {value}, not one of moe_layer_ids {list(m.moe_layer_ids)}")
        self._stash(table, table.num_rows, rids)

    def _stash(self, batch: Batch, n_rows: int, rids: list[str]) -> None:
        if n_rows == 0:
            return
        self._hand_in(lambda: self._inbox.add_rows(batch, n_rows, rids))

    def _hand_in(self, add: Callable[[], None]) -> None:
        """`add` to the inbox under the lock; then, if the flusher starves, wait for its commit (pending.Inbox)."""
        with self._lock:
            self._check_open()
            add()
            seen = None if self._error is not None else self._inbox.overdue()  # failing: the disk, not the GIL
        if seen is not None:
            self._inbox.wait_landed(seen)

    def add_request(
        self, request_id: str, *, tag: str | None = None, prompt_tokens: int | None = None,
        completion_tokens: int | None = None, finish_reason: str | None = None, arrival_ts: int | None = None,
        finish_ts: int | None = None, token_ids: list[int] | None = None,
    ) -> None:
        """One finished request, committed with (or after) its rows: call it after its last `append`."""
        row = dict(
            run_id=self.run_id, request_id=request_id, tag=tag, prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, finish_reason=finish_reason, arrival_ts=arrival_ts,
            finish_ts=finish_ts, token_ids=None if token_ids is None else [int(t) for t in token_ids],
        )
        self._hand_in(lambda: self._inbox.add_request(row))

    def add_placement(self, from_forward_id: int, layer_ids: Sequence[int], phy2log: Any,
                      ts_ns: int | None = None) -> None:
        """The expert placement the engine runs from forward from_forward_id on, for the MoE layers in layer_ids
        (phy2log [n, P]): committed before it returns (placements.py), unlike rows, since a map is written once a
        trace start or a rebalance chunk and a lost one would misattribute every later row's slots."""
        table = placement_table(self.manifest, from_forward_id, time.time_ns() if ts_ns is None else ts_ns,
                                layer_ids, phy2log)
        with self._committing:  # close() marks closing before its last commit: checked under the same lock
            with self._lock:
                self._check_open()
            self.manifest = self._committer.add_placement(table)

    def status(self) -> WriterStatus:
        with self._lock:
            buffered = self._inbox.pending.n_rows
            err = self._error
        c = self._committer
        m = c.manifest
        return WriterStatus(
            run_id=self.run_id, run_dir=str(self.run_dir), rows_buffered=buffered, rows_durable=m.rows,
            requests_durable=c.requests_committed,
            last_flush_age_s=time.monotonic() - c.last_commit_monotonic, commits=c.commits,
            compactions=c.compactions, files=len(m.files), last_error=None if err is None else f"{err}",
            stalled_s=self._inbox.stalled_s,
        )

    def flush(self) -> Manifest:
        """Commit what was handed over so far, now, from the calling thread; returns the manifest."""
        with self._lock:
            self._check_open()
            taken = self._inbox.take_all()
        try:
            self._commit(taken)
        except BaseException:
            with self._lock:
                self._inbox.pending.put_back(taken)
            raise
        return self.manifest

    def close(self, mark_unfinished: bool = True, engine: dict[str, Any] | None = None) -> Manifest:
        """Commit everything, merge the trailing small files, mark the run closed; returns the manifest.
        mark_unfinished: requests with rows and no add_request get a requests row with finish_reason
        "unfinished" (they were still running); False leaves them without one (offline tools whose input has
        no request summaries). engine: keys added to the manifest's engine record (what an ingest left out).
        Idempotent."""
        with self._lock:
            if self._closed:
                return self.manifest
            self._closing = True
            if mark_unfinished:
                self._inbox.pending.mark_unfinished(self.run_id)
        self._wake.set()
        self._flusher.join()
        with self._lock:
            taken = self._inbox.take_all()  # with what was handed over and not yet committed by the flusher
        try:
            self._commit(taken)
        except BaseException:
            with self._lock:  # nothing captured is dropped: a later close() tries again
                self._inbox.pending.put_back(taken)
                self._closing = False
            self._flusher = threading.Thread(target=self._flush_loop, name=self._flusher.name, daemon=True)
            self._flusher.start()
            raise
        c = self._committer
        with self._committing:
            c.compact(final=True)
            c.publish(replace(c.manifest, status="closed", open_requests=(), end_time=now_iso(),
                              engine={**c.manifest.engine, **(engine or {})}))
        self.manifest = c.manifest
        self._closed = True
        lifecycle.release_run_lock(self._run_lock)
        lifecycle.unregister_writer(self)
        return self.manifest

    # ---------------------------------------------------------------- flusher thread
    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise TraceSchemaError(f"run_id={self.run_id!r} writer is closed")

    def _flush_loop(self) -> None:
        while True:
            if self._closing:  # read without the lock (pending.Inbox): plain attribute reads under the GIL
                return
            due = self._inbox.pending.due_in(self.rows_per_file, self.flush_interval_s)
            if due is None or due > 0:
                self._wake.wait(timeout=due)
                self._wake.clear()  # a set() between wait and clear is not lost: the state is read again above
                continue
            taken = self._inbox.take_for_flusher()
            try:
                self._commit(taken, flusher=True)
                self._error = None
            except Exception as exc:  # a full disk, say: keep the rows, say so once, try again later
                with self._lock:
                    if self._error is None:
                        log.warning("trace %s: commit failed, will retry: %s", self.run_id, exc)
                    self._error = exc
                    self._inbox.pending.put_back(taken)
                self._wake.wait(timeout=min(self.flush_interval_s or 1.0, 5.0))
                self._wake.clear()

    def _commit(self, taken: Taken, flusher: bool = False) -> None:
        try:
            with self._committing:
                self._commit_files(taken)
        finally:
            self._inbox.landed(flusher)

    def _commit_files(self, taken: Taken) -> None:
        rows, requests, open_ids = taken
        if rows or requests:
            files = route_files(rows, self.manifest, self.rows_per_file)
            self.manifest = self._committer.commit(files, requests, open_ids)
