"""TraceWriter: the sink side of the trace contract (schema.py), one run per writer.

Crash bound: files are written as `part-XXXXX.parquet.tmp` and renamed when closed, then the manifest
is rewritten atomically. A killed writer loses the rows of the file still open plus its unflushed
buffer: at most `rows_per_file` + one appended batch (default 1M rows = 17K tokens of a 58-layer
model). `max_file_age_s` bounds the loss in time as well. Readers go by the manifest and never open
`.tmp` files; a complete file renamed just before the kill but not yet in the manifest is picked up by
`reader.recover_run`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from r3trace.trace.batch import Labels, expand_tokens, route_rows
from r3trace.trace.rollup import RollupAccumulator
from r3trace.trace.schema import (
    PARQUET_COMPRESSION,
    PARQUET_COMPRESSION_LEVEL,
    PHASES,
    REQUEST_SCHEMA,
    ROW_GROUP_ROWS,
    FileEntry,
    Manifest,
    TraceSchemaError,
    route_schema,
    run_dir_name,
    write_atomic,
)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def write_parquet_atomic(table: pa.Table, path: Path, row_group_rows: int = ROW_GROUP_ROWS) -> None:
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(
        table, tmp, compression=PARQUET_COMPRESSION, compression_level=PARQUET_COMPRESSION_LEVEL,
        use_dictionary=True, row_group_size=row_group_rows,
    )
    os.replace(tmp, path)


class TraceWriter:
    """Writes one run under `<root>/run_id=<run_id>/`. Not thread-safe: one writer per sink thread."""

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
        num_groups: int = 1,
        config_hash: str = "",
        engine: dict[str, Any] | None = None,
        parallel: dict[str, Any] | None = None,
        rows_per_file: int = 8 * ROW_GROUP_ROWS,
        flush_rows: int = ROW_GROUP_ROWS,
        rollup_window_s: float = 1.0,
        max_file_age_s: float | None = None,
    ) -> None:
        run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]
        self.manifest = Manifest(
            run_id=run_id, model_name=model_name, num_hidden_layers=num_hidden_layers,
            moe_layer_ids=tuple(int(x) for x in moe_layer_ids), num_experts=num_experts, top_k=top_k,
            with_weights=with_weights, num_groups=num_groups, config_hash=config_hash,
            engine=dict(engine or {}), parallel=dict(parallel or {}), start_time=_now(),
            rollup_window_ns=int(rollup_window_s * 1e9),
        )
        if rows_per_file < len(self.manifest.moe_layer_ids) or flush_rows <= 0:
            raise TraceSchemaError(
                f"rows_per_file={rows_per_file} must hold one token ({len(self.manifest.moe_layer_ids)} rows)"
                f" and flush_rows={flush_rows} must be > 0"
            )
        self.run_dir = Path(root) / run_dir_name(run_id)
        if (self.run_dir / "manifest.json").exists():
            raise TraceSchemaError(f"run_id={run_id!r} already exists under {root}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.rows_per_file = rows_per_file
        self.flush_rows = flush_rows
        self.max_file_age_s = max_file_age_s
        self.schema = route_schema(top_k, with_weights)
        self._rollup = RollupAccumulator(
            self.manifest.moe_layer_ids, num_experts, self.manifest.rollup_window_ns
        )
        self._buffer: list[pa.Table] = []
        self._buffered = 0
        self._file: pq.ParquetWriter | None = None
        self._file_rows = 0
        self._file_opened = 0.0
        self._fwd = [np.iinfo(np.int64).max, -1]
        self._requests: list[dict[str, Any]] = []
        self._closed = False
        self.manifest.write(self.run_dir)

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append_tokens(
        self,
        request_id: Labels,
        token_pos: Any,
        phase: Labels,
        source: Labels,
        forward_id: Any,
        ts: Any,
        dp_rank: Any,
        topk_ids: np.ndarray,
        topk_weights: np.ndarray | None = None,
    ) -> None:
        """T tokens: per-token columns [T] (or scalars), topk_ids [T, L, K] over the manifest's MoE layers."""
        kw = expand_tokens(self.manifest.moe_layer_ids, request_id, token_pos, phase, source, forward_id, ts,
                           dp_rank, topk_ids, topk_weights)
        self.append(**kw)

    def append(
        self,
        request_id: Labels,
        token_pos: Any,
        phase: Labels,
        source: Labels,
        forward_id: Any,
        ts: Any,
        dp_rank: Any,
        layer_id: Any,
        topk_ids: np.ndarray,
        topk_weights: np.ndarray | None = None,
    ) -> None:
        """N rows, token-major, one entry per row; topk_ids [N, K]. Validated before anything is buffered."""
        if self._closed:
            raise TraceSchemaError(f"run_id={self.run_id!r} writer is closed")
        m = self.manifest
        table = route_rows(m.run_id, request_id, token_pos, phase, source, forward_id, ts, dp_rank, layer_id,
                           topk_ids, topk_weights, num_experts=m.num_experts, top_k=m.top_k,
                           with_weights=m.with_weights)
        if table.num_rows == 0:
            return
        ts_ns = table.column("ts").combine_chunks().cast(pa.int64()).to_numpy()
        phase_codes = table.column("phase").combine_chunks().indices.to_numpy()
        ids = np.asarray(topk_ids).astype(np.int32, copy=False).reshape(table.num_rows, m.top_k)
        self._rollup.add(ts_ns, phase_codes, table.column("layer_id").to_numpy(), ids)
        fwd = table.column("forward_id").to_numpy()
        self._fwd = [min(self._fwd[0], int(fwd.min())), max(self._fwd[1], int(fwd.max()))]
        if self._file is None and not self._buffered:  # first rows of a new file
            self._file_opened = time.monotonic()
        self._buffer.append(table)
        self._buffered += table.num_rows
        if self._buffered >= self.flush_rows:
            self._flush()
        aged = self.max_file_age_s is not None and time.monotonic() - self._file_opened > self.max_file_age_s
        if self._file_rows + self._buffered >= self.rows_per_file or aged:
            self._close_file()

    def add_request(
        self,
        request_id: str,
        *,
        tag: str | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        finish_reason: str | None = None,
        arrival_ts: int | None = None,
        finish_ts: int | None = None,
        token_ids: list[int] | None = None,
    ) -> None:
        """One finished request; written to `requests-XXXXX.parquet` with the next routes file."""
        self._requests.append(dict(
            run_id=self.run_id, request_id=request_id, tag=tag, prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, finish_reason=finish_reason, arrival_ts=arrival_ts,
            finish_ts=finish_ts, token_ids=None if token_ids is None else [int(t) for t in token_ids],
        ))

    def _flush(self) -> None:
        if not self._buffered:
            return
        if self._file is None:
            self._file = pq.ParquetWriter(
                self._part_path().with_suffix(".parquet.tmp"), self.schema, compression=PARQUET_COMPRESSION,
                compression_level=PARQUET_COMPRESSION_LEVEL, use_dictionary=True,
            )
        table = pa.concat_tables(self._buffer) if len(self._buffer) > 1 else self._buffer[0]
        self._file.write_table(table, row_group_size=ROW_GROUP_ROWS)
        self._file_rows += table.num_rows
        self._buffer, self._buffered = [], 0

    def _part_path(self) -> Path:
        return self.run_dir / f"part-{len(self.manifest.files):05d}.parquet"

    def _close_file(self) -> None:
        self._flush()
        if self._file is None and not self._requests:
            return
        idx = len(self.manifest.files)
        part = self._part_path()
        if self._file is None:  # requests but no rows: an empty routes file keeps the pairing simple
            self._file = pq.ParquetWriter(part.with_suffix(".parquet.tmp"), self.schema)
        self._file.close()
        rollup = self.run_dir / f"rollup-{idx:05d}.parquet"
        write_parquet_atomic(self._rollup.table(self.run_id), rollup)
        requests = None
        if self._requests:
            requests = self.run_dir / f"requests-{idx:05d}.parquet"
            write_parquet_atomic(pa.Table.from_pylist(self._requests, schema=REQUEST_SCHEMA), requests)
        # The routes file is renamed last, right before the manifest names it: a kill in between leaves
        # one complete file the manifest misses (recover_run lists it), never a listed file that is absent.
        os.replace(part.with_suffix(".parquet.tmp"), part)
        entry = FileEntry(
            name=part.name, rows=self._file_rows, rollup=rollup.name,
            requests=None if requests is None else requests.name,
            min_forward_id=self._fwd[0] if self._file_rows else -1, max_forward_id=self._fwd[1],
        )
        self.manifest = replace(
            self.manifest, files=(*self.manifest.files, entry), rows=self.manifest.rows + self._file_rows,
            end_time=_now(),
        )
        self.manifest.write(self.run_dir)
        self._file, self._file_rows, self._requests = None, 0, []
        self._fwd = [np.iinfo(np.int64).max, -1]

    def close(self) -> Manifest:
        """Flush, close the open file, write the final manifest; returns it. Idempotent."""
        if not self._closed:
            self._close_file()
            self.manifest = replace(self.manifest, end_time=_now())
            self.manifest.write(self.run_dir)
            self._closed = True
        return self.manifest


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
