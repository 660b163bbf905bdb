"""Columnar input -> Arrow route rows: the one place that validates what sinks are given.

Shape legend: N rows, T tokens, L MoE layers, K top-k, E experts.
`route_rows(...)` takes one entry per row; `expand_tokens(...)` takes one entry per token plus
topk_ids [T, L, K] and expands to T*L rows, token-major, layers in `moe_layer_ids` order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa

from r3trace.trace.schema import PHASES, SOURCES, TraceSchemaError, route_schema

Labels: TypeAlias = "str | Sequence[str] | np.ndarray | pa.Array"


def label_codes(values: Labels, vocab: tuple[str, ...], n: int, name: str) -> np.ndarray:
    """Strings (or int codes) -> int32 codes into vocab; a scalar string broadcasts to n rows."""
    if isinstance(values, str):
        if values not in vocab:
            raise TraceSchemaError(f"column {name} value {values!r} not in {vocab}")
        return np.full(n, vocab.index(values), dtype=np.int32)
    arr = np.asarray(values)
    if arr.shape != (n,):
        raise TraceSchemaError(f"column {name} has shape {arr.shape}, expected ({n},)")
    if arr.dtype.kind in "iu":
        if n and (arr.min() < 0 or arr.max() >= len(vocab)):
            raise TraceSchemaError(f"column {name} code {int(arr.max())} outside 0..{len(vocab) - 1}")
        return arr.astype(np.int32)
    lookup = {v: i for i, v in enumerate(vocab)}
    uniq, inv = np.unique(arr.astype(str), return_inverse=True)
    bad = [u for u in uniq if u not in lookup]
    if bad:
        raise TraceSchemaError(f"column {name} value {bad[0]!r} not in {vocab}")
    return np.array([lookup[u] for u in uniq], dtype=np.int32)[inv]


def _column(values: Any, n: int, dtype: type, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim == 0:
        return np.full(n, arr, dtype=dtype)
    if arr.shape != (n,):
        raise TraceSchemaError(f"column {name} has shape {arr.shape}, expected ({n},)")
    return arr.astype(dtype, copy=False)


def _timestamps(ts: Any, n: int) -> np.ndarray:
    arr = np.asarray(ts)
    if arr.dtype.kind == "M":
        arr = arr.astype("datetime64[ns]").astype(np.int64)
    return _column(arr, n, np.int64, "ts")


def _dictionary(codes: np.ndarray, vocab: Sequence[str]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(list(vocab), pa.string()))


def string_rows(values: Sequence[str] | np.ndarray, repeat: int = 1) -> pa.Array:
    """Strings, each repeated `repeat` times; built through a dictionary (few requests, many rows)."""
    uniq, inv = np.unique(np.asarray(values).astype(str), return_inverse=True)
    codes = np.repeat(inv.astype(np.int32), repeat) if repeat > 1 else inv.astype(np.int32)
    return _dictionary(codes, list(uniq)).cast(pa.string())


def check_ids(topk_ids: np.ndarray, num_experts: int, k: int) -> np.ndarray:
    """topk_ids [..., K] -> int32, every id in 0..E-1 (dense layers are never rows, so -1 is refused)."""
    ids = np.asarray(topk_ids)
    if ids.shape[-1] != k:
        raise TraceSchemaError(f"column topk_ids has {ids.shape[-1]} entries per layer, manifest says {k}")
    if ids.dtype.kind not in "iu":
        raise TraceSchemaError(f"column topk_ids has dtype {ids.dtype}, expected an integer type")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise TraceSchemaError(f"column topk_ids holds {bad}, outside 0..{num_experts - 1}")
    return ids.astype(np.int32, copy=False)


def repeated_experts(ids: np.ndarray) -> np.ndarray:
    """ids [..., K] -> bool [...]: the rows whose K ids name one expert twice. A router picks K distinct experts, so a
    repeat marks a broken capture: SGLang's host buffer hands back zeros ([0] * K) for KV slots its capturer never
    wrote, and an export with its layer and top-k axes swapped repeats ids too. One sort of the K ids a row: 14 ms
    for 4,096 tokens x 58 layers x 8 on a 2-core CPU against check_ids' 1 ms, so ingest pays it, not the writer's
    per-forward check."""
    if ids.shape[-1] < 2:
        return np.zeros(ids.shape[:-1], dtype=bool)
    ranked = np.sort(ids, axis=-1)
    return (ranked[..., 1:] == ranked[..., :-1]).any(-1)


def repeated_tokens(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ids [T, L, K] -> (bool [T] the tokens repeating an expert on some layer, bool [T] those all zeros)."""
    bad = repeated_experts(ids).any(axis=1).reshape(len(ids))  # [T]
    return bad, bad & (ids == 0).all(axis=(1, 2))


def check_physical_ids(physical_ids: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    """physical_ids of the same shape as topk_ids -> int32, every slot >= 0 (the manifest does not hold P, so no
    upper bound is checked). Missing or misshapen is refused, as topk_weights are under with_weights."""
    if physical_ids is None:
        raise TraceSchemaError("column physical_ids is missing, manifest says with_physical_ids=True")
    phys = np.asarray(physical_ids)
    if phys.shape != shape:
        raise TraceSchemaError(f"column physical_ids has shape {phys.shape}, expected {shape}")
    if phys.dtype.kind not in "iu":
        raise TraceSchemaError(f"column physical_ids has dtype {phys.dtype}, expected an integer type")
    if phys.size and int(phys.min()) < 0:
        raise TraceSchemaError(f"column physical_ids holds {int(phys.min())}, physical slots start at 0")
    return phys.astype(np.int32)


def route_rows(
    run_id: str,
    request_id: Labels,
    token_pos: Any,
    phase: Labels,
    source: Labels,
    forward_id: Any,
    ts: Any,
    dp_rank: Any,
    layer_id: Any,
    topk_ids: np.ndarray,
    topk_weights: np.ndarray | None,
    physical_ids: np.ndarray | None = None,
    *,
    num_experts: int,
    top_k: int,
    with_weights: bool,
    with_physical_ids: bool = False,
) -> pa.Table:
    """One entry per row (N rows): topk_ids [N, K], topk_weights [N, K] or None, physical_ids [N, K] or None ->
    routes table [N]."""
    ids = np.asarray(topk_ids)
    if ids.ndim != 2:
        raise TraceSchemaError(f"column topk_ids has shape {ids.shape}, expected [N, K]")
    n, k = ids.shape
    ids = check_ids(ids, num_experts, top_k)
    if isinstance(request_id, str):
        rid: pa.Array = pa.array([request_id], pa.string()).take(np.zeros(n, dtype=np.int64))
    else:
        rid = request_id if isinstance(request_id, pa.Array) else string_rows(request_id)
        if len(rid) != n:
            raise TraceSchemaError(f"column request_id has {len(rid)} rows, expected {n}")
    cols: list[pa.Array] = [
        _dictionary(np.zeros(n, dtype=np.int32), [run_id]),
        rid,
        pa.array(_column(token_pos, n, np.int32, "token_pos")),
        _dictionary(label_codes(phase, PHASES, n, "phase"), PHASES),
        _dictionary(label_codes(source, SOURCES, n, "source"), SOURCES),
        pa.array(_column(forward_id, n, np.int64, "forward_id")),
        pa.array(_timestamps(ts, n), pa.timestamp("ns")),
        pa.array(_column(dp_rank, n, np.int16, "dp_rank")),
        pa.array(_column(layer_id, n, np.int16, "layer_id")),
        pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), k),
    ]
    if with_weights:
        if topk_weights is None:
            raise TraceSchemaError("column topk_weights is missing, manifest says with_weights=True")
        w = np.asarray(topk_weights, dtype=np.float16)
        if w.shape != ids.shape:
            raise TraceSchemaError(f"column topk_weights has shape {w.shape}, expected {ids.shape}")
        cols.append(pa.FixedSizeListArray.from_arrays(pa.array(w.reshape(-1)), k))
    if with_physical_ids:
        phys = check_physical_ids(physical_ids, ids.shape)
        cols.append(pa.FixedSizeListArray.from_arrays(pa.array(phys.reshape(-1)), k))
    return pa.Table.from_arrays(cols, schema=route_schema(k, with_weights, with_physical_ids))


def expand_tokens(
    moe_layer_ids: Sequence[int],
    request_id: Labels,
    token_pos: Any,
    phase: Labels,
    source: Labels,
    forward_id: Any,
    ts: Any,
    dp_rank: Any,
    topk_ids: np.ndarray,
    topk_weights: np.ndarray | None,
    physical_ids: np.ndarray | None = None,
) -> dict[str, Any]:
    """One entry per token (T tokens), topk_ids [T, L, K] -> route_rows kwargs for T*L rows, token-major."""
    ids = np.asarray(topk_ids)
    n_layers = len(moe_layer_ids)
    if ids.ndim != 3 or ids.shape[1] != n_layers:
        raise TraceSchemaError(f"column topk_ids has shape {ids.shape}, expected [T, {n_layers}, K]")
    t = ids.shape[0]

    def per_token(values: Any, name: str) -> Any:
        if isinstance(values, str):
            return values
        arr = np.asarray(values)
        if arr.ndim == 0:
            return arr
        if arr.shape[0] != t:
            raise TraceSchemaError(f"column {name} has {arr.shape[0]} tokens, topk_ids has {t}")
        return np.repeat(arr, n_layers)

    if isinstance(request_id, str):
        rid: Any = request_id
    else:
        if len(request_id) != t:
            raise TraceSchemaError(f"column request_id has {len(request_id)} tokens, topk_ids has {t}")
        rid = string_rows(request_id, n_layers)
    return {
        "request_id": rid,
        "token_pos": per_token(token_pos, "token_pos"),
        "phase": per_token(phase, "phase"),
        "source": per_token(source, "source"),
        "forward_id": per_token(forward_id, "forward_id"),
        "ts": per_token(ts, "ts"),
        "dp_rank": per_token(dp_rank, "dp_rank"),
        "layer_id": np.tile(np.asarray(moe_layer_ids, dtype=np.int16), t),
        "topk_ids": ids.reshape(t * n_layers, ids.shape[2]),
        "topk_weights": None if topk_weights is None else np.asarray(topk_weights).reshape(t * n_layers, -1),
        "physical_ids": None if physical_ids is None else check_physical_ids(physical_ids, ids.shape).reshape(
            t * n_layers, ids.shape[2]),
    }

