"""Readers: a dataset folder of many runs, seen only through their manifests.

A file is part of a run exactly when the run's manifest lists it, so a reader never sees a `.tmp`
file, a file a live writer is still filling, or the inputs of a compaction. A run is "recording" while
its writer lives, "closed" once closed, and "crashed" when its writer died before closing (the kernel
dropped its lock): the requests then in flight are in the manifest's `open_requests`, reported as
unfinished (`unfinished_requests`) and written as such by `recover_run`. `TokenRoutes` is the token-major
numpy view the simulator and the numpy metrics use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from r3trace.trace.commit import now_iso, write_parquet_atomic
from r3trace.trace.layout import TABLES, Table, file_table, table_dir
from r3trace.trace.lifecycle import run_is_live
from r3trace.trace.schema import MANIFEST_NAME, PHASES, REQUEST_SCHEMA, FileEntry, Manifest, TraceSchemaError

RunState = Literal["recording", "closed", "crashed"]
UNFINISHED = "unfinished"  # finish_reason of a request whose writer stopped before it finished


def run_state(run_dir: Path, manifest: Manifest) -> RunState:
    if manifest.status == "closed":
        return "closed"
    return "recording" if run_is_live(run_dir) else "crashed"


@dataclass(frozen=True)
class RunFiles:
    manifest: Manifest
    run_dir: Path
    state: RunState = "closed"

    def unfinished_requests(self) -> list[dict[str, Any]]:
        """Requests-table rows (finish_reason "unfinished") for the requests a crashed writer left in flight."""
        if self.state != "crashed":
            return []
        return [{"run_id": self.manifest.run_id, "request_id": rid, "finish_reason": UNFINISHED}
                for rid in self.manifest.open_requests]

    def table_dir(self, table: Table) -> Path:
        """The folder of one table's files: `<root>/<table>/run_id=<id>`, or the run folder (layout 1)."""
        return table_dir(self.run_dir, self.manifest.schema_version, table)

    @property
    def route_files(self) -> list[Path]:
        return [self.table_dir("routes") / f.name for f in self.manifest.files if f.name]

    @property
    def rollup_files(self) -> list[Path]:
        return [self.table_dir("rollups") / f.rollup for f in self.manifest.files if f.rollup]

    @property
    def rollups_complete(self) -> bool:
        """Every routes file listed with its rollup (as TraceWriter commits them), so the rollups' heat is the
        routes' heat; a trace written to the Parquet contract by another tool may list routes files alone."""
        return all(f.rollup for f in self.manifest.files if f.name)

    @property
    def request_files(self) -> list[Path]:
        return [self.table_dir("requests") / f.requests for f in self.manifest.files if f.requests]

    @property
    def placement_files(self) -> list[Path]:
        return [self.table_dir("placements") / name for name in self.manifest.placements]

    @property
    def listed_files(self) -> list[Path]:
        """Every file the manifest lists, table by table."""
        return [*self.route_files, *self.rollup_files, *self.request_files, *self.placement_files]

    def unlisted_files(self) -> list[Path]:
        """Files in the run's folders that its manifest does not list: `.tmp` writes and `.parquet` files
        renamed before a kill could write the manifest, or a compaction's inputs or output."""
        listed = set(self.listed_files)
        dirs = sorted({self.run_dir, *(self.table_dir(t) for t in TABLES)})
        return [p for d in dirs if d.is_dir() for p in sorted(d.iterdir()) if p.is_file() and (
            p.name.endswith(".tmp") or (p.suffix == ".parquet" and p not in listed))]


def open_dataset(roots: str | Path | Sequence[str | Path]) -> list[RunFiles]:
    """Every run under one or more dataset folders (or run folders), sorted by run_id.

    A path is a run folder when it holds manifest.json, else a dataset folder of `run_id=*` folders.
    Two runs with the same run_id raise TraceSchemaError.
    """
    paths = [roots] if isinstance(roots, (str, Path)) else list(roots)
    runs: dict[str, RunFiles] = {}
    for root in map(Path, paths):
        if not root.is_dir():
            raise TraceSchemaError(f"trace path {root} is not a folder")
        dirs = [root] if (root / MANIFEST_NAME).exists() else sorted(root.glob("run_id=*"))
        for d in dirs:
            if not (d / MANIFEST_NAME).exists():
                continue  # a run folder whose writer has not written its first manifest yet
            m = Manifest.read(d)
            if m.run_id in runs:
                raise TraceSchemaError(f"run_id={m.run_id!r} appears twice: {runs[m.run_id].run_dir} and {d}")
            runs[m.run_id] = RunFiles(m, d, run_state(d, m))
    return [runs[k] for k in sorted(runs)]


def routes_dataset(runs: Iterable[RunFiles]) -> ds.Dataset:
    """A pyarrow dataset over the complete routes files of the given runs."""
    files = [str(p) for r in runs for p in r.route_files]
    return ds.dataset(files, format="parquet")


class TokenRoutes(NamedTuple):
    """One run, token-major: T tokens, L MoE layers (manifest order), K top-k."""

    request_id: np.ndarray  # [T] str
    token_pos: np.ndarray  # [T] int32
    phase: np.ndarray  # [T] int32 code into PHASES
    forward_id: np.ndarray  # [T] int64
    dp_rank: np.ndarray  # [T] int16
    topk_ids: np.ndarray  # [T, L, K] int32


def read_token_routes(run: RunFiles, max_tokens: int | None = None) -> TokenRoutes:
    """The run's routes as [T, L, K]; needs every token to carry all L MoE layers (what sinks write)."""
    m = run.manifest
    n_layers, k = m.num_moe_layers, m.top_k
    cols = ["request_id", "token_pos", "phase", "forward_id", "dp_rank", "layer_id", "topk_ids"]
    parts = []
    rows = 0
    for path in run.route_files:
        t = pq.read_table(path, columns=cols)
        parts.append(t)
        rows += t.num_rows
        if max_tokens is not None and rows >= max_tokens * n_layers:
            break
    table = pa.concat_tables(parts) if parts else pq.read_schema(run.route_files[0]).empty_table()
    if max_tokens is not None:
        table = table.slice(0, max_tokens * n_layers)
    table = table.unify_dictionaries()  # Parquet row groups carry their own phase dictionaries
    if table.num_rows % n_layers:
        raise TraceSchemaError(f"run {m.run_id}: {table.num_rows} rows, not a multiple of L={n_layers}")
    t_count = table.num_rows // n_layers
    layer = table.column("layer_id").to_numpy().reshape(t_count, n_layers)
    if t_count and not (layer == np.asarray(m.moe_layer_ids, dtype=layer.dtype)).all():
        raise TraceSchemaError(f"run {m.run_id}: rows not token-major over moe_layer_ids {m.moe_layer_ids}")
    ids = table.column("topk_ids").combine_chunks().flatten().to_numpy().reshape(t_count, n_layers, k)
    first = pa.array(np.arange(0, table.num_rows, n_layers))
    phase = pc.take(table.column("phase"), first).combine_chunks()
    phase_codes = np.asarray([PHASES.index(s) for s in phase.dictionary.to_pylist()], dtype=np.int32)
    return TokenRoutes(
        request_id=pc.take(table.column("request_id"), first).to_numpy(zero_copy_only=False),
        token_pos=pc.take(table.column("token_pos"), first).to_numpy(),
        phase=phase_codes[phase.indices.to_numpy()] if len(phase) else np.zeros(0, np.int32),
        forward_id=pc.take(table.column("forward_id"), first).to_numpy(),
        dp_rank=pc.take(table.column("dp_rank"), first).to_numpy(),
        topk_ids=ids,
    )


def recover_run(run_dir: str | Path) -> Manifest:
    """After a crash: delete what the manifest does not list (`.tmp` files, files renamed just before the kill,
    compaction outputs or inputs), write the requests left in flight as unfinished, mark the run closed.

    Files are committed only by the manifest, so this removes no committed row; what it deletes holds at most
    the commit the kill interrupted. Refused while a live writer holds the run."""
    run_dir = Path(run_dir)
    m = Manifest.read(run_dir)
    state = run_state(run_dir, m)
    if state == "recording":
        raise TraceSchemaError(f"run {m.run_id}: a live writer still records it ({run_dir}); stop it first")
    if state == "closed":
        return m
    run = RunFiles(m, run_dir, "crashed")
    for path in run.unlisted_files():
        path.unlink()
    listed = {n for f in m.files for n in (f.name, f.rollup, f.requests) if n}
    files = m.files
    if m.open_requests:
        seq = 1 + max((int(n.split("-")[1].split(".")[0]) for n in listed), default=-1)
        name = f"requests-{seq:05d}.parquet"
        table = pa.Table.from_pylist(run.unfinished_requests(), schema=REQUEST_SCHEMA)
        folder = run.table_dir("requests")
        folder.mkdir(parents=True, exist_ok=True)
        table = table if folder == run_dir else file_table(table, m)  # layout 1 keeps run_id in its files
        write_parquet_atomic(table, folder / name, fsync=m.fsync, staging=run_dir)
        files = (*files, FileEntry(name="", rows=0, requests=name))
    m = replace(m, files=files, status="closed", open_requests=(), end_time=m.end_time or now_iso())
    m.write(run_dir)
    return m
