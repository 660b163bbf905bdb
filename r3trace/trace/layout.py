"""Where a run's files live on disk, the shape facts each Parquet file carries, and the move from layout 1.

Layout 2 (manifest schema_version 2, what TraceWriter writes): one top-level folder per table, each
hive-partitioned by run id, so the obvious call of a plain reader on a table folder reads that table only,
with correct counts (pyarrow.dataset(root / "routes", partitioning="hive"), polars.scan_parquet,
DuckDB read_parquet('<root>/routes/**/*.parquet'), Spark's spark.read.parquet):

    <root>/run_id=<id>/manifest.json               the run's commit point: lists every complete file
    <root>/run_id=<id>/.writer.lock                held while a writer records (lifecycle.py)
    <root>/routes/run_id=<id>/part-N.parquet       one row per (request, token position, MoE layer)
    <root>/rollups/run_id=<id>/rollup-N.parquet    per (window, layer, expert, phase): count
    <root>/requests/run_id=<id>/requests-N.parquet one row per finished request
    <root>/placements/run_id=<id>/placement-N.parquet  the expert placement the engine ran (placements.py)

run_id is the partition: it is in the path and not in the files, so readers that add it from the path never
meet a second, differently typed copy (it used to be a dictionary column in the file and a string in the path).
A file in flight is written as `.<name>.tmp` in the run's manifest folder and renamed into its table folder, so
a table folder holds complete Parquet files only, even while a writer records.

Layout 1 (schema_version 1): every file beside manifest.json, run_id a column in each. r3trace's readers read
both; `migrate_run` (the `r3trace migrate` command) rewrites a layout-1 run as layout 2, manifest last.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq

from r3trace.trace.schema import SCHEMA_VERSION, Manifest, TraceSchemaError

Table = Literal["routes", "rollups", "requests", "placements"]
TABLES: tuple[Table, ...] = ("routes", "rollups", "requests", "placements")
GROUP_TABLES: tuple[Table, ...] = ("routes", "rollups", "requests")  # the files one group commit writes (FileEntry)
PARTITION = "run_id"  # the hive partition column: a folder name, never a column inside a layout-2 file
FIRST_TABLE_LAYOUT = 2  # the schema_version from which files live in per-table folders


def table_dir(run_dir: Path, schema_version: int, table: Table) -> Path:
    """The folder of one table's files of the run whose manifest is in `run_dir` (`<root>/run_id=<id>`)."""
    if schema_version < FIRST_TABLE_LAYOUT:
        return run_dir
    return run_dir.parent / table / run_dir.name


def tmp_path(path: Path, staging: Path | None = None) -> Path:
    """Where `path` is written before its rename: `.<name>.tmp` in `staging` (the run's manifest folder, outside
    the table folders that plain readers list: polars reads every file of a folder, dot files too)."""
    return (staging or path.parent) / f".{path.name}.tmp"


def without_partition(schema: pa.Schema) -> pa.Schema:
    """A table's schema as stored in a layout-2 file: the partition column dropped."""
    i = schema.get_field_index(PARTITION)
    return schema if i < 0 else schema.remove(i)


def shape_metadata(m: Manifest) -> dict[str, str]:
    """The model-shape facts every Parquet file carries in its key-value metadata, JSON-encoded values, so a
    file read alone says how to read topk_ids: L = len(moe_layer_ids) rows per token, K ids per row in 0..E-1."""
    return {
        "num_hidden_layers": json.dumps(m.num_hidden_layers),
        "moe_layer_ids": json.dumps(list(m.moe_layer_ids)),
        "top_k": json.dumps(m.top_k),
        "num_experts": json.dumps(m.num_experts),
        "r3trace_schema_version": json.dumps(SCHEMA_VERSION),
    }


def file_table(table: pa.Table, m: Manifest) -> pa.Table:
    """A table as a layout-2 file stores it: no partition column, the shape facts in the schema metadata."""
    if PARTITION in table.column_names:
        table = table.drop_columns([PARTITION])
    meta = dict(table.schema.metadata or {})
    meta.update({k.encode(): v.encode() for k, v in shape_metadata(m).items()})
    return table.replace_schema_metadata(meta)


def migrate_run(run_dir: Path, fsync: bool = True) -> Manifest:
    """Rewrite a closed layout-1 run as layout 2; returns its new manifest (unchanged if already layout 2).

    Each listed file is written into its table folder first; the layout-2 manifest is then written over the old
    one in one atomic rename (the commit point), and only then are the old files deleted. A stop before the
    manifest write leaves the run as it was plus unlisted copies; a stop after it leaves unlisted old files."""
    from r3trace.trace.commit import write_parquet_atomic  # commit.py imports this module
    from r3trace.trace.reader import RunFiles, run_state

    m = Manifest.read(run_dir)
    if m.schema_version >= FIRST_TABLE_LAYOUT:
        return m
    state = run_state(run_dir, m)
    if state != "closed":
        raise TraceSchemaError(f"run {m.run_id}: state {state!r}, migrate needs 'closed' (recover_run a crashed run)")
    old = RunFiles(m, run_dir)
    new = replace(m, schema_version=SCHEMA_VERSION)
    fresh = RunFiles(new, run_dir)
    for src, dst in [*zip(old.route_files, fresh.route_files, strict=True),
                     *zip(old.rollup_files, fresh.rollup_files, strict=True),
                     *zip(old.request_files, fresh.request_files, strict=True)]:
        dst.parent.mkdir(parents=True, exist_ok=True)
        t = pq.read_table(src)
        write_parquet_atomic(file_table(t, new), dst, fsync=fsync, staging=run_dir)
    new.write(run_dir)
    for src in [*old.route_files, *old.rollup_files, *old.request_files]:
        src.unlink(missing_ok=True)
    return new
