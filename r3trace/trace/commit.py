"""RunFiles on disk: group commits and compaction of one run, the manifest as the single commit point.

A commit writes `part-N.parquet` (routes), `rollup-N.parquet` and, when requests finished,
`requests-N.parquet`, each into its table's folder (layout.py) as `.tmp` + fsync + rename, then rewrites
manifest.json atomically. A file
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

from r3trace.trace.layout import GROUP_TABLES, Table, file_table, table_dir, tmp_path, without_partition
from r3trace.trace.pending import Batch
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
)
from r3trace.trace.tokens import merge_tokens, tokens_table


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def write_parquet_atomic(
    table: pa.Table, path: Path, row_group_rows: int = ROW_GROUP_ROWS, fsync: bool = False,
    staging: Path | None = None,
) -> None:
    """`.name.tmp` in `staging` (default: beside `path`), (fsync), rename: the final name only ever holds a
    complete file. A run stages in its manifest folder, so a table folder holds complete files only."""
    tmp = tmp_path(path, staging)
    pq.write_table(
        table, tmp, compression=PARQUET_COMPRESSION, compression_level=PARQUET_COMPRESSION_LEVEL,
        use_dictionary=True, row_group_size=row_group_rows,
    )
    if fsync:
        fsync_path(tmp)
    os.replace(tmp, path)


def merge_rollups(tables: Sequence[pa.Table]) -> pa.Table:
    """Rollup tables of several files -> one, counts summed per (window, layer, expert, phase); run_id kept
    where the inputs hold it (files of layout 2 do not: it is their folder's name)."""
    schema = ROLLUP_SCHEMA if tables and "run_id" in tables[0].column_names else without_partition(ROLLUP_SCHEMA)
    t = pa.concat_tables([x.cast(schema) for x in tables]) if tables else schema.empty_table()
    if t.num_rows == 0:
        return schema.empty_table()
    keys = [k for k in ("run_id", "window_start", "layer_id", "expert_id", "phase") if k in schema.names]
    g = t.group_by(keys).aggregate([("count", "sum")]).rename_columns([*keys, "count"])
    g = g.sort_by([(k, "ascending") for k in keys if k != "run_id"])
    return g.select(schema.names).cast(schema)


def route_files(
    rows: Sequence[tuple[Batch, int]], m: Manifest, rows_per_file: int
) -> list[tuple[list[pa.Table], pa.Table]]:
    """The (routes tables, rollup) of each file one commit writes: the taken rows split into files of
    <= rows_per_file rows at appended-batch boundaries (so tokens stay whole). append_tokens' batches of a file
    are merged first and built as one table: one build per file, however many small appends it holds."""
    groups: list[list[Batch]] = [[]]
    n = 0
    for batch, n_rows in rows:
        if groups[-1] and n + n_rows > rows_per_file:
            groups.append([])
            n = 0
        groups[-1].append(batch)
        n += n_rows
    files = []
    for group in groups:
        acc = RollupAccumulator(m.moe_layer_ids, m.num_experts, m.rollup_window_ns)
        tables = [b for b in group if isinstance(b, pa.Table)]
        # the rollup counts logical ids (topk_ids) only, with or without physical_ids
        for t in tables:  # route_rows encodes phase over all of PHASES: its indices are the phase codes
            ids = t.column("topk_ids").combine_chunks().flatten().to_numpy().reshape(t.num_rows, m.top_k)
            acc.add(t.column("ts").cast(pa.int64()).to_numpy(),
                    t.column("phase").combine_chunks().indices.to_numpy(), t.column("layer_id").to_numpy(), ids)
        tokens = [b for b in group if not isinstance(b, pa.Table)]
        if tokens:
            merged = merge_tokens(tokens)
            tables.append(tokens_table(m.run_id, m.moe_layer_ids, m.top_k, m.with_weights, merged,
                                       m.with_physical_ids))
            acc.add_tokens(merged["ts"], merged["phase"], merged["topk_ids"])
        files.append((tables, acc.table(m.run_id)))
    return files


class RunCommitter:
    """Owns the files of one run folder; called from one thread at a time (the writer's flusher)."""

    def __init__(
        self, run_dir: Path, manifest: Manifest, schema: pa.Schema, *, fsync: bool, small_rows: int, fanin: int,
        max_rows: int, row_group_rows: int = ROW_GROUP_ROWS,
    ) -> None:
        self.run_dir = run_dir
        self.manifest = manifest
        self.schema = schema
        self.file_schema = without_partition(schema)  # run_id is the files' folder name, not a column
        self.dirs: dict[Table, Path] = {t: table_dir(run_dir, manifest.schema_version, t) for t in GROUP_TABLES}
        for d in self.dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        if fsync:  # the new folders' entries, so a power loss cannot drop a folder whose files were fsynced
            for d in {run_dir.parent, *(d.parent for d in self.dirs.values())}:
                fsync_path(d)
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
        d = self.dirs
        return (d["routes"] / f"part-{n:05d}.parquet", d["rollups"] / f"rollup-{n:05d}.parquet",
                d["requests"] / f"requests-{n:05d}.parquet")

    def _write_entry(self, routes: pa.Table, rollup: pa.Table, requests: pa.Table | None, level: int) -> FileEntry:
        part, roll, req = self._paths()
        m = self.manifest
        write_parquet_atomic(file_table(routes, m), part, self.row_group_rows, self.fsync, self.run_dir)
        write_parquet_atomic(file_table(rollup, m), roll, self.row_group_rows, self.fsync, self.run_dir)
        if requests is not None and requests.num_rows:
            write_parquet_atomic(file_table(requests, m), req, self.row_group_rows, self.fsync, self.run_dir)
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
            for d in {*self.dirs.values(), self.run_dir}:  # the renames above, before the manifest names them
                fsync_path(d)
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

    def add_placement(self, table: pa.Table) -> Manifest:
        """One placements file (placements.py), written and listed by one manifest write; its folder is made on the
        first, so a run without placements has no empty folder for readers to meet."""
        folder = table_dir(self.run_dir, self.manifest.schema_version, "placements")
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            if self.fsync:
                fsync_path(folder.parent)
                fsync_path(folder.parent.parent)
        m = self.manifest
        path = folder / f"placement-{len(m.placements):05d}.parquet"
        write_parquet_atomic(file_table(table, m), path, self.row_group_rows, self.fsync, self.run_dir)
        if self.fsync:
            fsync_path(folder)
        self.publish(replace(m, placements=(*m.placements, path.name)))
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
        d = self.dirs
        routes = pa.concat_tables([pq.read_table(d["routes"] / f.name).cast(self.file_schema) for f in group])
        rollup = merge_rollups([pq.read_table(d["rollups"] / f.rollup) for f in group if f.rollup])
        reqs = [pq.read_table(d["requests"] / f.requests) for f in group if f.requests]
        entry = self._write_entry(
            routes if routes.num_rows else self.file_schema.empty_table(), rollup,
            pa.concat_tables(reqs) if reqs else None, level=max(f.level for f in group) + 1,
        )
        self.publish(replace(m, files=(*m.files[:lo], entry, *m.files[hi:])))
        for f in group:  # no longer listed: readers that go by the manifest never open them again
            for table, name in zip(GROUP_TABLES, (f.name, f.rollup, f.requests), strict=True):
                if name:
                    (d[table] / name).unlink(missing_ok=True)
        self.compactions += 1


def write_heat_run(
    root: str | Path, manifest: Manifest, counts: np.ndarray, window_start_ns: int | Sequence[int] = 0,
    phase: str = "decode",
) -> Manifest:
    """A heat-only run (kind="heat"): counts [L, E] at window_start_ns, or [W, L, E] at W starts (windows landing in
    one rollup window add up), as one rollup file, no routes. Returns the manifest."""
    counts = np.asarray(counts)
    starts = [window_start_ns] if isinstance(window_start_ns, (int, np.integer)) else list(window_start_ns)
    shape = (manifest.num_moe_layers, manifest.num_experts)
    stacked = counts if counts.ndim == 3 else counts[None]  # [W, L, E]
    if stacked.ndim != 3 or stacked.shape[1:] != shape or len(stacked) != len(starts):
        raise TraceSchemaError(f"heat counts have shape {counts.shape}, manifest says {shape} "
                               f"({len(starts)} window starts)")
    if phase not in PHASES:
        raise TraceSchemaError(f"heat phase {phase!r} not in {PHASES}")
    run_dir = Path(root) / run_dir_name(manifest.run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    rollups = table_dir(run_dir, manifest.schema_version, "rollups")
    rollups.mkdir(parents=True, exist_ok=True)
    acc = RollupAccumulator(manifest.moe_layer_ids, manifest.num_experts, manifest.rollup_window_ns)
    for start, c in zip(starts, stacked, strict=True):
        key = (start // manifest.rollup_window_ns, PHASES.index(phase))
        acc.counts[key] = acc.counts.get(key, 0) + c.astype(np.int64)
    write_parquet_atomic(file_table(acc.table(manifest.run_id), manifest), rollups / "rollup-00000.parquet",
                         staging=run_dir)
    done = replace(manifest, kind="heat", files=(FileEntry(name="", rows=0, rollup="rollup-00000.parquet"),))
    done.write(run_dir)
    return done
