"""TraceStore: one or more dataset folders as DuckDB views on an explicit connection.

Views (one row per ...):
  routes    (run_id, request_id, token_pos, MoE layer): the Parquet rows as written
  tokens    (run_id, request_id, token_pos, forward_id): routes at the run's first MoE layer
  requests  (run_id, request_id): tag (domain), token counts, finish reason
  runs      (run_id): the manifest fields, moe_layer_ids as a list, engine/parallel as JSON text
  rollups   (run_id, window_start, layer_id, expert_id, phase): count
  placements (run_id, from_forward_id, layer_id): phy2log, the map an engine ran from that forward on
            (r3trace/trace/placements.py); a layer's map at forward f is its row with the largest
            from_forward_id <= f

Only files listed in manifests are read, so a live writer's open file is never visible. `open_store` is
the constructor for callers that need runs (the CLI): a missing path, a file, an unreadable manifest or a
store without runs is a StoreError that names the path and what to do. Read-only
mode is for untrusted SQL: statements other than SELECT are refused before they run, DuckDB's external
access is switched off except for the store folders, and the configuration (memory, threads) is locked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa

from r3trace.errors import StoreError
from r3trace.progress import duckdb_progress
from r3trace.trace.layout import FIRST_TABLE_LAYOUT, TABLES, Table
from r3trace.trace.placements import PLACEMENT_SCHEMA
from r3trace.trace.reader import RunFiles, open_dataset
from r3trace.trace.schema import MANIFEST_NAME, REQUEST_SCHEMA, ROLLUP_SCHEMA, Manifest, route_schema

if TYPE_CHECKING:  # polars is imported where a frame is built: the store's views and SQL need duckdb alone
    import polars as pl

_FILES: dict[Table, str] = {"routes": "route_files", "rollups": "rollup_files", "requests": "request_files",
                            "placements": "placement_files"}


class StoreQueryError(PermissionError):
    """A statement the read-only store refuses; the message names the statement type."""


@dataclass(frozen=True)
class ReadOnlyLimits:
    """Limits for untrusted SQL; 2 threads and 2 GB fit the 2-core, 23 GB analysis machine."""

    memory_limit: str = "2GB"
    threads: int = 2
    max_temp_directory_size: str = "0B"  # no spilling: a spill file would be a write outside the store


def query_frame(
    con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any] | None = None,
    progress: bool | None = False, desc: str = "query",
) -> pl.DataFrame:
    """Runs `sql` with `?` parameters on a fresh cursor of `con`; the whole result as a DataFrame.

    `progress` (r3trace/progress.py): a percent bar on stderr labelled `desc`, from DuckDB's estimate."""
    import polars as pl

    cur = con.cursor()
    try:
        with duckdb_progress(cur, progress, desc):
            rel = cur.sql(sql, params=list(params or []))
            out = pl.from_arrow(rel.to_arrow_table()) if rel is not None else pl.DataFrame()
    finally:
        cur.close()
    assert isinstance(out, pl.DataFrame)  # from_arrow of a Table is always a DataFrame
    return out


def _sql_list(paths: Sequence[Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def _empty_select(schema: pa.Schema) -> str:
    duck = {"dictionary<values=string, indices=int32, ordered=0>": "VARCHAR", "string": "VARCHAR",
            "int16": "SMALLINT", "int32": "INTEGER", "int64": "BIGINT", "timestamp[ns]": "TIMESTAMP_NS"}
    cols = []
    for f in schema:
        t = duck.get(str(f.type), "INTEGER[]")
        cols.append(f"NULL::{t} AS {f.name}")
    return "SELECT " + ", ".join(cols) + " WHERE false"


_PLACEHOLDER = Manifest(run_id="-", model_name="", num_hidden_layers=1, moe_layer_ids=(0,), num_experts=1,
                        top_k=1)


def _runs_row(m: Manifest, run_dir: Path) -> dict[str, Any]:
    """One row of the `runs` table: the manifest's fields, moe_layer_ids as a list, engine/parallel as JSON."""
    d = asdict(m)
    d.pop("files")
    d["engine"], d["parallel"] = json.dumps(d["engine"]), json.dumps(d["parallel"])
    d["moe_layer_ids"] = list(d["moe_layer_ids"])
    d["first_moe_layer"] = d["moe_layer_ids"][0]
    d["file_count"] = m.file_count
    d["run_dir"] = str(run_dir)
    return d


class TraceStore:
    """Views over the runs found under `paths` (dataset folders or run folders) on `self.con`."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        read_only: bool = False,
        limits: ReadOnlyLimits = ReadOnlyLimits(),
        con: duckdb.DuckDBPyConnection | None = None,
    ) -> None:
        self.paths = [Path(p).resolve() for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        for p in self.paths:
            check_store_path(p)
        self.runs: list[RunFiles] = open_dataset(self.paths)
        self.read_only = read_only
        self.con = con if con is not None else duckdb.connect()
        self.con.execute("SET enable_progress_bar = false")
        self._create_views()
        if read_only:
            self._lock(limits)

    def run(self, run_id: str) -> RunFiles:
        for r in self.runs:
            if r.manifest.run_id == run_id:
                return r
        known = [r.manifest.run_id for r in self.runs]
        raise KeyError(f"run_id={run_id!r} not in store {self.paths}; runs: {known}")

    def _create_views(self) -> None:
        c = self.con
        k = max((r.manifest.top_k for r in self.runs), default=8)

        def source(table: Table, schema: pa.Schema) -> str:
            """One table's listed files: layout-2 files get run_id from their folder, layout-1 files hold it."""
            files = {True: [], False: []}  # type: dict[bool, list[Path]]
            for r in self.runs:
                files[r.manifest.schema_version >= FIRST_TABLE_LAYOUT] += getattr(r, _FILES[table])
            parts = []
            if files[True]:
                opts = "hive_partitioning=true, hive_types={'run_id': 'VARCHAR'}, union_by_name=true"
                parts.append(f"SELECT run_id, * EXCLUDE (run_id) FROM read_parquet({_sql_list(files[True])}, {opts})")
            if files[False]:
                opts = "hive_partitioning=false, union_by_name=true"
                parts.append(f"SELECT * REPLACE (CAST(run_id AS VARCHAR) AS run_id)"
                             f" FROM read_parquet({_sql_list(files[False])}, {opts})")
            return " UNION ALL BY NAME ".join(parts) if parts else _empty_select(schema)

        c.execute(f"CREATE OR REPLACE VIEW routes AS {source('routes', route_schema(k, False))}")
        c.execute(f"CREATE OR REPLACE VIEW rollups AS {source('rollups', ROLLUP_SCHEMA)}")
        c.execute(f"CREATE OR REPLACE VIEW placements AS {source('placements', PLACEMENT_SCHEMA)}")
        # Requests a crashed writer left in flight (reader.RunFiles.unfinished_requests) are rows too, with
        # finish_reason 'unfinished': their routes are in the files, their summary never was.
        unfinished = [row for r in self.runs for row in r.unfinished_requests()]
        c.register("_unfinished_arrow", pa.Table.from_pylist(unfinished, schema=REQUEST_SCHEMA))
        c.execute("CREATE OR REPLACE TABLE _unfinished_requests AS SELECT * FROM _unfinished_arrow")
        c.unregister("_unfinished_arrow")
        c.execute(f"CREATE OR REPLACE VIEW requests AS {source('requests', REQUEST_SCHEMA)}"
                  " UNION ALL BY NAME SELECT * FROM _unfinished_requests")
        rows = [_runs_row(r.manifest, r.run_dir) for r in self.runs]
        # no runs: the same columns, zero rows (from a placeholder manifest), so queries on `runs` still bind
        runs_table = pa.Table.from_pylist(rows or [_runs_row(_PLACEHOLDER, Path())])
        runs_table = runs_table if rows else runs_table.slice(0, 0)
        # materialised, not a view of a Python object: replacement scans stop working once locked down
        c.register("_runs_arrow", runs_table)
        c.execute("CREATE OR REPLACE TABLE runs AS SELECT * FROM _runs_arrow")
        c.unregister("_runs_arrow")
        if rows:
            c.execute(
                "CREATE OR REPLACE VIEW tokens AS SELECT r.run_id, r.request_id, r.token_pos, r.phase,"
                " r.source, r.forward_id, r.ts, r.dp_rank FROM routes r JOIN runs USING (run_id)"
                " WHERE r.layer_id = runs.first_moe_layer"
            )
        else:
            c.execute("CREATE OR REPLACE VIEW tokens AS SELECT * EXCLUDE (layer_id, topk_ids) FROM routes")

    def _lock(self, limits: ReadOnlyLimits) -> None:
        c = self.con
        allowed = [str(p) + "/" for p in self.paths]
        c.execute(f"SET allowed_directories = {_sql_list([Path(a) for a in allowed])}")
        c.execute("SET autoinstall_known_extensions = false")
        c.execute("SET autoload_known_extensions = false")
        c.execute(f"SET memory_limit = '{limits.memory_limit}'")
        c.execute(f"SET threads = {int(limits.threads)}")
        c.execute(f"SET max_temp_directory_size = '{limits.max_temp_directory_size}'")
        c.execute("SET enable_external_access = false")
        c.execute("SET lock_configuration = true")

    def check_statement(self, sql: str) -> None:
        """Raises StoreQueryError unless every statement is a SELECT (read-only mode only)."""
        if not self.read_only:
            return
        for st in self.con.extract_statements(sql):
            if st.type != duckdb.StatementType.SELECT:
                msg = f"statement type {st.type.name} refused: the read-only store runs SELECT only"
                raise StoreQueryError(msg)

    def query(self, sql: str, params: Sequence[Any] | None = None) -> pl.DataFrame:
        """Runs `sql` with `?` parameters on a fresh cursor; returns its result [rows x columns]."""
        self.check_statement(sql)
        return query_frame(self.con, sql, params)

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A cursor for one thread (DuckDB connections are not shared across threads)."""
        return self.con.cursor()


def check_store_path(path: Path) -> None:
    """Raises StoreError unless `path` is an existing folder; the message says what it is instead."""
    if not path.exists():
        raise StoreError(f"store {path} does not exist (give a dataset folder of run_id=* runs, or one run folder)")
    if not path.is_dir():
        what = "a run's manifest" if path.name == MANIFEST_NAME else "a file"
        raise StoreError(f"store {path} is {what}, not a folder (give the folder that holds it: {path.parent})")


def _run_dirs(root: Path) -> list[Path]:
    # the discovery open_dataset does: a run folder holds manifest.json, a dataset folder holds run_id=* folders
    return [root] if (root / MANIFEST_NAME).exists() else sorted(root.glob("run_id=*"))


def _check_manifest(run_dir: Path) -> None:
    path = run_dir / MANIFEST_NAME
    if not path.exists():
        return  # a writer that has not written its first manifest yet: skipped, as open_dataset does
    try:
        Manifest.read(run_dir)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # TraceSchemaError is a ValueError
        msg = str(e) if str(path) in str(e) else f"manifest {path}: {e}"
        raise StoreError(f"{msg} (fix that file, or move {run_dir} out of the store)") from e


def _no_runs_message(roots: Sequence[Path]) -> str:
    where = str(roots[0]) if len(roots) == 1 else str([str(r) for r in roots])
    waiting = sum(1 for r in roots for d in r.glob("run_id=*") if d.is_dir() and not (d / MANIFEST_NAME).exists())
    other = sorted(p.name for r in roots for p in r.iterdir()
                   if not p.name.startswith(("run_id=", ".")) and p.name not in TABLES)
    msg = f"no r3trace runs under {where} (expected run_id=*/manifest.json"
    if waiting:
        msg += f"; {waiting} run_id=* folders have no manifest.json yet"
    if other:
        shown = ", ".join(other[:3]) + (f", ... ({len(other)} in all)" if len(other) > 3 else "")
        msg += f"; found other entries: {shown}"
    return msg + ")"


def open_store(
    paths: str | Path | Sequence[str | Path], *, read_only: bool = False, limits: ReadOnlyLimits = ReadOnlyLimits()
) -> TraceStore:
    """A TraceStore that holds at least one run, for a caller that needs one (the CLI); else StoreError.

    Each manifest is checked first so that an unreadable one is reported with its path (the manifest
    reader's own schema errors do not name the file)."""
    roots = [Path(p).resolve() for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    for root in roots:
        check_store_path(root)
        for run_dir in _run_dirs(root):
            _check_manifest(run_dir)
    store = TraceStore(roots, read_only=read_only, limits=limits)
    if not store.runs:
        raise StoreError(_no_runs_message(roots))
    return store
