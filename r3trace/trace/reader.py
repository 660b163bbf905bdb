"""Readers: a dataset folder of many runs, seen only through their manifests.

A file is part of a run exactly when the run's manifest lists it, so a reader never sees a `.tmp`
file or a file a live writer is still filling. `TokenRoutes` is the token-major numpy view the
simulator and the numpy metrics use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from r3trace.trace.rollup import RollupAccumulator
from r3trace.trace.schema import MANIFEST_NAME, PHASES, FileEntry, Manifest, TraceSchemaError
from r3trace.trace.writer import write_parquet_atomic


@dataclass(frozen=True)
class RunFiles:
    manifest: Manifest
    run_dir: Path

    @property
    def route_files(self) -> list[Path]:
        return [self.run_dir / f.name for f in self.manifest.files if f.name]

    @property
    def rollup_files(self) -> list[Path]:
        return [self.run_dir / f.rollup for f in self.manifest.files if f.rollup]

    @property
    def request_files(self) -> list[Path]:
        return [self.run_dir / f.requests for f in self.manifest.files if f.requests]


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
            runs[m.run_id] = RunFiles(m, d)
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
    """After a crash: drop `.tmp` files, list complete routes files the manifest missed; returns it."""
    run_dir = Path(run_dir)
    m = Manifest.read(run_dir)
    for tmp in run_dir.glob("*.tmp"):
        tmp.unlink()
    known = {f.name for f in m.files}
    files = list(m.files)
    rows = m.rows
    for part in sorted(run_dir.glob("part-*.parquet")):
        if part.name in known:
            continue
        table = pq.read_table(part)  # raises on a torn file: renames happen only after a complete write
        idx = part.name.removeprefix("part-").removesuffix(".parquet")
        rollup = run_dir / f"rollup-{idx}.parquet"
        if not rollup.exists():
            acc = RollupAccumulator(m.moe_layer_ids, m.num_experts, m.rollup_window_ns)
            table = table.unify_dictionaries()
            ph = table.column("phase").combine_chunks()
            codes = np.asarray([PHASES.index(s) for s in ph.dictionary.to_pylist()], np.int32)[ph.indices]
            ids = table.column("topk_ids").combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
            ts = table.column("ts").cast(pa.int64()).to_numpy()
            acc.add(ts, codes, table.column("layer_id").to_numpy(), ids)
            write_parquet_atomic(acc.table(m.run_id), rollup)
        fwd = table.column("forward_id").to_numpy()
        files.append(FileEntry(name=part.name, rows=table.num_rows, rollup=rollup.name,
                               min_forward_id=int(fwd.min()) if len(fwd) else -1,
                               max_forward_id=int(fwd.max()) if len(fwd) else -1))
        rows += table.num_rows
    m = replace(m, files=tuple(files), rows=rows)
    m.write(run_dir)
    return m
