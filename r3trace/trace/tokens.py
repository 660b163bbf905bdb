"""append_tokens' path through the writer: checked per token on the caller's thread, built into rows later.

Shape legend: T tokens, L MoE layers, K top-k, E experts. The caller (the engine's scheduler thread, once per
forward) pays `check_tokens`: a few numpy passes over T entries and the [T, L, K] ids. The flusher thread then
merges a commit's batches once a file (`merge_tokens`) into its table (`tokens_table`) and its heat rollup at token
level (`RollupAccumulator.add_tokens`): a commit of 4K tokens x 58 layers (64 requests x 63 decode steps) builds in a
few milliseconds, with no per-row Python strings, so the flusher holds the GIL, which the scheduler thread
needs, for as little as it can.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from r3trace.trace.batch import Labels, _column, _dictionary, _timestamps, check_ids, check_physical_ids, label_codes
from r3trace.trace.schema import PHASES, SOURCES, TraceSchemaError, route_schema


def check_tokens(
    moe_layer_ids: Sequence[int], num_experts: int, top_k: int, with_weights: bool, request_id: Labels,
    token_pos: Any, phase: Labels, source: Labels, forward_id: Any, ts: Any, dp_rank: Any, topk_ids: np.ndarray,
    topk_weights: np.ndarray | None, with_physical_ids: bool = False, physical_ids: np.ndarray | None = None,
) -> dict[str, Any]:
    """append_tokens' arguments validated at token granularity and normalised to [T] arrays (labels as codes,
    request ids as a list), ids [T, L, K] int32: what route_rows would refuse is refused here. Copies: the writer
    keeps them until a commit, and a caller may reuse its buffers."""
    ids = np.asarray(topk_ids)
    n_layers = len(moe_layer_ids)
    if ids.ndim != 3 or ids.shape[1] != n_layers:
        raise TraceSchemaError(f"column topk_ids has shape {ids.shape}, expected [T, {n_layers}, K]")
    t = ids.shape[0]
    ids = check_ids(ids, num_experts, top_k)
    if isinstance(request_id, str):
        rids = [request_id] * t
    else:
        rids = [str(r) for r in (request_id.to_pylist() if isinstance(request_id, pa.Array) else request_id)]
        if len(rids) != t:
            raise TraceSchemaError(f"column request_id has {len(rids)} tokens, topk_ids has {t}")
    weights = None
    if with_weights:
        if topk_weights is None:
            raise TraceSchemaError("column topk_weights is missing, manifest says with_weights=True")
        if np.shape(topk_weights) != ids.shape:
            raise TraceSchemaError(f"column topk_weights has shape {np.shape(topk_weights)}, expected {ids.shape}")
        weights = np.array(topk_weights, dtype=np.float16)
    phys = check_physical_ids(physical_ids, ids.shape) if with_physical_ids else None  # [T, L, K], a copy
    return {
        "request_id": rids, "token_pos": _column(token_pos, t, np.int32, "token_pos").copy(),
        "phase": label_codes(phase, PHASES, t, "phase"), "source": label_codes(source, SOURCES, t, "source"),
        "forward_id": _column(forward_id, t, np.int64, "forward_id").copy(), "ts": _timestamps(ts, t).copy(),
        "dp_rank": _column(dp_rank, t, np.int16, "dp_rank").copy(), "topk_ids": np.array(ids, np.int32),
        "topk_weights": weights, "physical_ids": phys,
    }


def merge_tokens(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """check_tokens outputs, in order -> one batch of all their tokens: each column concatenated once (a commit's
    table and its rollup both read the merged ids), request ids chained; one batch is returned as it is."""
    if len(batches) == 1:
        return batches[0]
    out: dict[str, Any] = {"request_id": [r for b in batches for r in b["request_id"]]}
    for key, first in batches[0].items():
        if key != "request_id":
            out[key] = None if first is None else np.concatenate([b[key] for b in batches])
    return out


def tokens_table(run_id: str, moe_layer_ids: Sequence[int], top_k: int, with_weights: bool,
                 batch: dict[str, Any], with_physical_ids: bool = False) -> pa.Table:
    """One check_tokens output (merge_tokens: several) -> a routes table of T * L rows, token-major, layers in
    manifest order."""
    n_layers = len(moe_layer_ids)

    def per_row(key: str) -> np.ndarray:  # [T] -> [T * L]
        return np.repeat(batch[key], n_layers)

    lookup: dict[str, int] = {}
    codes = np.fromiter((lookup.setdefault(r, len(lookup)) for r in batch["request_id"]), np.int32)
    ids = batch["topk_ids"]  # [T, L, K]
    t = len(ids)
    cols: list[pa.Array] = [
        _dictionary(np.zeros(t * n_layers, dtype=np.int32), [run_id]),
        _dictionary(np.repeat(codes, n_layers), list(lookup)).cast(pa.string()),
        pa.array(per_row("token_pos")),
        _dictionary(per_row("phase"), PHASES),
        _dictionary(per_row("source"), SOURCES),
        pa.array(per_row("forward_id")),
        pa.array(per_row("ts"), pa.timestamp("ns")),
        pa.array(per_row("dp_rank")),
        pa.array(np.tile(np.asarray(moe_layer_ids, dtype=np.int16), t)),
        pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), top_k),
    ]
    if with_weights:
        cols.append(pa.FixedSizeListArray.from_arrays(pa.array(batch["topk_weights"].reshape(-1)), top_k))
    if with_physical_ids:  # [T, L, K], rows as topk_ids
        cols.append(pa.FixedSizeListArray.from_arrays(pa.array(batch["physical_ids"].reshape(-1)), top_k))
    return pa.Table.from_arrays(cols, schema=route_schema(top_k, with_weights, with_physical_ids))


def distinct(request_id: Labels) -> list[str]:
    """The distinct request ids of a column (or the one id of a scalar)."""
    if isinstance(request_id, str):
        return [request_id]
    if isinstance(request_id, list):
        return list(dict.fromkeys(request_id))  # the capturer's [rid] * n: n hashes of one cached string
    if isinstance(request_id, pa.Array):
        return [str(x) for x in request_id.unique().to_pylist()]
    return [str(x) for x in np.unique(np.asarray(request_id))]
