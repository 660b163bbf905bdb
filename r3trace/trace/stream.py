"""Arrow IPC stream of route batches, for consumers that want rows as they come (a file or a pipe).

The stream carries the same columns as the Parquet files (schema.route_schema); the run's manifest
travels as JSON in the schema metadata under b"r3trace.manifest", so a consumer knows E, K and the
MoE layer ids before the first batch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from r3trace.trace.batch import Labels, expand_tokens, route_rows
from r3trace.trace.schema import Manifest, route_schema

MANIFEST_KEY = b"r3trace.manifest"


class TraceStreamWriter:
    """Writes one record batch per `append_tokens` call to `sink` (a path or a binary file object)."""

    def __init__(self, sink: str | BinaryIO, manifest: Manifest) -> None:
        self.manifest = manifest
        schema = route_schema(manifest.top_k, manifest.with_weights, manifest.with_physical_ids).with_metadata(
            {MANIFEST_KEY: manifest.to_json().encode()}
        )
        self._writer = pa.ipc.new_stream(sink, schema)
        self.rows = 0

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
        physical_ids: np.ndarray | None = None,
    ) -> None:
        """Same arguments as TraceWriter.append_tokens: topk_ids [T, L, K] -> T*L rows in one batch."""
        m = self.manifest
        kw = expand_tokens(m.moe_layer_ids, request_id, token_pos, phase, source, forward_id, ts, dp_rank,
                           topk_ids, topk_weights, physical_ids if m.with_physical_ids else None)
        table = route_rows(m.run_id, **kw, num_experts=m.num_experts, top_k=m.top_k,
                           with_weights=m.with_weights, with_physical_ids=m.with_physical_ids)
        self._writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TraceStreamWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_stream(source: str | BinaryIO) -> tuple[Manifest, Iterator[pa.RecordBatch]]:
    """The manifest from the stream's schema metadata and an iterator over its record batches."""
    reader = pa.ipc.open_stream(source)
    meta = reader.schema.metadata or {}
    manifest = Manifest.from_dict(json.loads(meta[MANIFEST_KEY]))
    return manifest, iter(reader)
