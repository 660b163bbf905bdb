"""RunFiles on disk: group commits and compaction of one run, the manifest as the single commit point.

A commit writes `part-N.parquet` (routes), `rollup-N.parquet` and, when requests finished,
`requests-N.parquet`, each as `.tmp` + fsync + rename, then rewrites manifest.json atomically. A file
is part of the run exactly when the manifest lists it: a kill before the manifest write leaves files
that `reader.recover_run` deletes, never a listed file that is absent or torn.

Compaction keeps a low-rate run from becoming thousands of tiny files (one commit a second is 3,600
an hour): once `fanin` consecutive files of one level below `small_rows` sit at the end of the list,
they are rewritten as one file of the next level, listed in their place by one manifest write, and then
deleted. A row is rewritten at most log_fanin(small_rows / rows per commit) times (about 3 at 8 and
128K rows against 1K-row commits); runs that commit >= small_rows rows at a time are never compacted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from r3trace.trace.rollup import RollupAccumulator
from r3trace.trace.schema import (
    PARQUET_COMPRESSION,
    PARQUET_COMPRESSION_LEVEL,
    PHASES,
    REQUEST_SCHEMA,
    ROLLUP_SCHEMA,
    ROW_GROUP_ROWS,
    FileEntry,
    Manifest,
    TraceSchemaError,
    fsync_path,
    run_dir_name,
    write_atomic,
)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def write_parquet_atomic(
    table: pa.Table, path: Path, row_group_rows: int = ROW_GROUP_ROWS, fsync: bool = False
) -> None:
    """`path.tmp`, (fsync), rename: the final name only ever holds a complete file."""
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(
        table, tmp, compression=PARQUET_COMPRESSION, compression_level=PARQUET_COMPRESSION_LEVEL,
        use_dictionary=True, row_group_size=row_group_rows,
    )
    if fsync:
        fsync_path(tmp)
    os.replace(tmp, path)


def merge_rollups(tables: Sequence[pa.Table]) -> pa.Table:
    """Rollup tables of several files -> one, counts summed per (window, layer, expert, phase)."""
    t = pa.concat_tables(tables)
    if t.num_rows == 0:
        return ROLLUP_SCHEMA.empty_table()
    keys = ["run_id", "window_start", "layer_id", "expert_id", "phase"]
    g = t.group_by(keys).aggregate([("count", "sum")]).rename_columns([*keys, "count"])
    g = g.sort_by([(k, "ascending") for k in keys[1:]])
    return g.select([f.name for f in ROLLUP_SCHEMA]).cast(ROLLUP_SCHEMA)


class RunCommitter:
    """Owns the files of one run folder; called from one thread at a time (the writer's flusher)."""

    def __init__(
        self, run_dir: Path, manifest: Manifest, schema: pa.Schema, *, fsync: bool, small_rows: int, fanin: int,
        max_rows: int, row_group_rows: int = ROW_GROUP_ROWS,
    ) -> None:
        self.run_dir = run_dir
        self.manifest = manifest
        self.schema = schema
        self.fsync = fsync
        self.small_rows = small_rows
        self.fanin = fanin
        self.max_rows = max_rows
        self.row_group_rows = row_group_rows
        self._seq = 0  # file numbers are never reused, so a compacted file never takes an input's name
        self.last_commit_monotonic = time.monotonic()
        self.commits = 0
        self.compactions = 0
        self.requests_committed = 0

    def _paths(self) -> tuple[Path, Path, Path]:
        n = self._seq
        self._seq += 1
        d = self.run_dir
        return d / f"part-{n:05d}.parquet", d / f"rollup-{n:05d}.parquet", d / f"requests-{n:05d}.parquet"

    def _write_entry(self, routes: pa.Table, rollup: pa.Table, requests: pa.Table | None, level: int) -> FileEntry:
        part, roll, req = self._paths()
        write_parquet_atomic(routes, part, self.row_group_rows, self.fsync)
        write_parquet_atomic(rollup, roll, self.row_group_rows, self.fsync)
        if requests is not None and requests.num_rows:
            write_parquet_atomic(requests, req, self.row_group_rows, self.fsync)
        else:
            req = None  # type: ignore[assignment]
        fwd = routes.column("forward_id")
        return FileEntry(
            name=part.name, rows=routes.num_rows, rollup=roll.name, requests=None if req is None else req.name,
            min_forward_id=int(pc.min(fwd).as_py()) if routes.num_rows else -1,
            max_forward_id=int(pc.max(fwd).as_py()) if routes.num_rows else -1, level=level,
        )

    def publish(self, manifest: Manifest) -> None:
        if self.fsync:
            fsync_path(self.run_dir)  # the renames above, before the manifest names them
        manifest.write(self.run_dir)
        self.manifest = manifest

    def commit(
        self, groups: Sequence[tuple[Sequence[pa.Table], pa.Table]], requests: list[dict[str, Any]],
        open_requests: tuple[str, ...],
    ) -> Manifest:
        """One group commit, one manifest write: a file per (routes, rollup) group, the finished requests with the
        last; then maybe a compaction."""
        entries = []
        for i, (routes, rollup) in enumerate(groups):
            table = pa.concat_tables(routes) if routes else self.schema.empty_table()
            last = i == len(groups) - 1
            req_table = pa.Table.from_pylist(requests, schema=REQUEST_SCHEMA) if requests and last else None
            entries.append(self._write_entry(table, rollup, req_table, level=0))
        m = self.manifest
        self.publish(replace(m, files=(*m.files, *entries), rows=m.rows + sum(e.rows for e in entries),
                              open_requests=open_requests, end_time=now_iso()))
        self.commits += 1
        self.requests_committed += len(requests)
        self.last_commit_monotonic = time.monotonic()
        self.compact(final=False)
        return self.manifest

    def compact(self, final: bool) -> None:
        """Merge trailing small files into one of at most `max_rows` rows: `fanin` files of one level at a time
        while recording, or (final, at close) as many as fit."""
        while True:
            files = self.manifest.files
            tail = rows = 0
            while tail < len(files):
                f = files[-1 - tail]
                if f.rows >= self.small_rows or rows + f.rows > self.max_rows or (
                    not final and (f.level != files[-1].level or tail == self.fanin)
                ):
                    break
                tail, rows = tail + 1, rows + f.rows
            if tail < (2 if final else self.fanin):
                return
            self._merge(len(files) - tail, len(files))
            if final:
                return

    def _merge(self, lo: int, hi: int) -> None:
        m = self.manifest
        group = m.files[lo:hi]
        d = self.run_dir
        routes = pa.concat_tables([pq.read_table(d / f.name) for f in group])
        rollup = merge_rollups([pq.read_table(d / f.rollup) for f in group if f.rollup])
        reqs = [pq.read_table(d / f.requests) for f in group if f.requests]
        entry = self._write_entry(
            routes.cast(self.schema) if routes.num_rows else self.schema.empty_table(), rollup,
            pa.concat_tables(reqs) if reqs else None, level=max(f.level for f in group) + 1,
        )
        self.publish(replace(m, files=(*m.files[:lo], entry, *m.files[hi:])))
        for f in group:  # no longer listed: readers that go by the manifest never open them again
            for name in (f.name, f.rollup, f.requests):
                if name:
                    (d / name).unlink(missing_ok=True)
        self.compactions += 1


def write_heat_run(
    root: str | Path, manifest: Manifest, counts: np.ndarray, window_start_ns: int = 0, phase: str = "decode"
) -> Manifest:
    """A heat-only run (kind="heat"): counts [L, E] as one rollup file, no routes. Returns the manifest."""
    counts = np.asarray(counts)
    shape = (manifest.num_moe_layers, manifest.num_experts)
    if counts.shape != shape:
        raise TraceSchemaError(f"heat counts have shape {counts.shape}, manifest says {shape}")
    if phase not in PHASES:
        raise TraceSchemaError(f"heat phase {phase!r} not in {PHASES}")
    run_dir = Path(root) / run_dir_name(manifest.run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    acc = RollupAccumulator(manifest.moe_layer_ids, manifest.num_experts, manifest.rollup_window_ns)
    acc.counts[(window_start_ns // manifest.rollup_window_ns, PHASES.index(phase))] = counts.astype(np.int64)
    write_parquet_atomic(acc.table(manifest.run_id), run_dir / "rollup-00000.parquet")
    done = replace(manifest, kind="heat", files=(FileEntry(name="", rows=0, rollup="rollup-00000.parquet"),))
    write_atomic(run_dir / "manifest.json", done.to_json().encode())
    return done
