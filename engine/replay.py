"""Routing replay's inputs: forced routes parsed and checked against the rows a request computes, and the
forced rows of one forward (the ReplayPlan the router reads). docs/replay.md is the contract.

Shape legend: L num_hidden_layers, K top-k, E routed experts, T tokens of one forward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from r3trace.capture.wire import WireFormatError, decode_array

from .forward_batch import ReplayPlan
from .model_config import ModelConfig
from .request import InvalidRequestError
from .route_options import ReplayRoutes
from .step import ScheduledReq


class ComputedRows(NamedTuple):
    """The positions a request forwards: [0, n); `why` spells n out for error messages."""

    n: int
    limit: int  # rows a replay may give: n, + 1 for the last sampled token's (never forwarded, ignored)
    why: str
    prompt_len: int


def computed_rows(prompt_len: int, max_new_tokens: int, max_context_len: int) -> ComputedRows:
    """Rows a request computes when it runs to max_new_tokens: every prompt position, then one per sampled
    token but the last (it is returned, never forwarded); a prefill-only request (max_new_tokens = 0)
    computes its prompt. The context limit stops a request at max_context_len - 1 forwarded positions."""
    if max_new_tokens == 0:
        return ComputedRows(prompt_len, prompt_len, f"prompt {prompt_len}, max_new_tokens 0", prompt_len)
    count = prompt_len + max_new_tokens - 1
    why = f"prompt {prompt_len} + max_new_tokens {max_new_tokens} - 1"
    if count > max_context_len - 1:
        count, why = max_context_len - 1, f"{why}, capped at max_context_len {max_context_len} - 1"
    return ComputedRows(count, count + 1, why, prompt_len)


def replay_routes(value: Any, start: Any, cfg: ModelConfig, rows: ComputedRows) -> ReplayRoutes:
    """Parse and check one request's forced routes against the rows it computes.

    start None (full replay): the routes must cover every computed row [0, rows.n). start s (partial
    replay): the n rows given force positions [s, s + n), which must lie inside the request."""
    name, start_name = "routed_experts", "routed_experts_replay_start_len"
    ids = parse_replay(value, cfg)
    n = len(ids)
    if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
        raise InvalidRequestError(start_name, f"{start!r} must be an integer >= 0 (or null for a full replay)")
    if n == 0:
        raise InvalidRequestError(
            name, f"0 rows given (empty); this request computes {rows.n} ({rows.why}); omit routed_experts "
            "to route freely"
        )
    if start is None and n < rows.n:
        fewer = ", lower max_new_tokens" if n >= rows.prompt_len else ""
        raise InvalidRequestError(
            name, f"{n} rows given, this request computes {rows.n} ({rows.why}); give all {rows.n}{fewer}, "
            f"or pass {start_name} to force only rows [start, start + {n}) (partial replay)"
        )
    first = 0 if start is None else start
    if first + n > rows.limit:
        where = f"rows [{first}, {first + n})" if start is not None else f"{n} rows"
        raise InvalidRequestError(
            name, f"{where} given; this request computes {rows.n} ({rows.why}), rows [0, {rows.limit}) at most"
        )
    check_expert_ids(ids, cfg)
    return ReplayRoutes(ids=ids, start=first)


def parse_replay(value: Any, cfg: ModelConfig) -> np.ndarray:
    """Forced routes (base64, an array or a trace reference) -> int32 [rows, L, K], the shape checked (an
    empty input is 0 rows); every problem is an InvalidRequestError."""
    name = "routed_experts"
    shape_tail = (cfg.num_hidden_layers, cfg.num_experts_per_tok)
    if isinstance(value, dict) and "trace" in value:
        value = _from_trace(value, cfg)
    if isinstance(value, (str, bytes)):
        try:
            flat = decode_array(value, "int32")
        except WireFormatError as exc:
            raise InvalidRequestError(name, str(exc)) from exc
        per_row = int(np.prod(shape_tail))
        if flat.size % per_row:
            raise InvalidRequestError(
                name, f"{flat.size} ids are not a whole number of rows of [L={shape_tail[0]}, K={shape_tail[1]}]"
            )
        arr = flat.reshape(-1, *shape_tail)
    elif isinstance(value, (np.ndarray, torch.Tensor, list)):
        arr = np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value)
        if arr.size == 0:
            return np.zeros((0, *shape_tail), np.int32)
        if arr.ndim != 3 or tuple(arr.shape[1:]) != shape_tail:
            raise InvalidRequestError(
                name, f"shape {list(arr.shape)}; expected [rows, num_hidden_layers={shape_tail[0]}, K={shape_tail[1]}]"
            )
        if not np.issubdtype(arr.dtype, np.integer):
            raise InvalidRequestError(name, f"dtype {arr.dtype}; expected integer expert ids")
        arr = arr.astype(np.int32)
    else:
        raise InvalidRequestError(name, f"a {type(value).__name__}; expected base64, an array or a trace reference")
    return arr


def check_expert_ids(arr: np.ndarray, cfg: ModelConfig) -> None:
    """Every MoE layer's ids of every row inside 0..E-1 and distinct (dense layers are not read)."""
    name = "routed_experts"
    moe = arr[:, list(cfg.moe_layer_ids)]
    bad = (moe < 0) | (moe >= cfg.n_routed_experts)
    if bad.any():
        r, layer, _ = np.argwhere(bad)[0]
        raise InvalidRequestError(
            name, f"row {r} layer {cfg.moe_layer_ids[layer]}: expert id {int(moe[r, layer].max())} outside "
            f"0..{cfg.n_routed_experts - 1}"
        )
    dup = (np.sort(moe, axis=-1)[..., 1:] == np.sort(moe, axis=-1)[..., :-1]).any(-1)
    if dup.any():
        r, layer = np.argwhere(dup)[0]
        raise InvalidRequestError(name, f"row {r} layer {cfg.moe_layer_ids[layer]}: an expert id repeats")


def _from_trace(ref: dict[str, Any], cfg: ModelConfig) -> np.ndarray:
    """{"trace": dir, "request_id": rid, "run_id": optional} -> [rows, L, K] from a recorded trace."""
    import duckdb

    root, rid = Path(ref["trace"]), ref.get("request_id")
    if not root.exists() or rid is None:
        raise InvalidRequestError(
            "routed_experts", f"trace reference needs an existing 'trace' dir and a 'request_id': {ref}"
        )
    from r3trace.trace.reader import open_dataset
    from r3trace.trace.schema import TraceSchemaError

    try:  # only the files the manifests list: never a crashed commit's leftovers or a compaction's inputs
        runs = [r for r in open_dataset(root) if ref.get("run_id") in (None, r.manifest.run_id)]
    except TraceSchemaError as exc:
        raise InvalidRequestError("routed_experts", f"trace {root}: {exc}") from exc
    files = [str(p) for r in runs for p in r.route_files]
    rows = duckdb.connect().execute(
        f"SELECT token_pos, layer_id, topk_ids FROM read_parquet({files}) WHERE request_id = ? "
        "ORDER BY token_pos, layer_id", [rid],
    ).fetchall() if files else []
    if not rows:
        raise InvalidRequestError("routed_experts", f"request_id {rid!r} not found in trace {root}")
    n = max(r[0] for r in rows) + 1
    out = np.full((n, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, np.int32)
    for pos, layer, ids in rows:
        out[pos, layer] = ids
    return out


def replay_plan(
    items: list[ScheduledReq], num_tokens: int, cfg: ModelConfig, device: str,
    stage: Callable[[np.ndarray], torch.Tensor] | None = None,
) -> ReplayPlan | None:
    """Forced ids for the rows of this forward whose request carries replay routes, else None. stage: how host
    arrays reach the device (the runner's HostStaging: no wait on the step in flight); default a plain copy."""
    forced = [(it, it.req.replay) for it in items]
    if all(r is None for _, r in forced):
        return None
    ids = np.zeros((num_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok), np.int32)
    mask = np.zeros(num_tokens, bool)
    row = 0
    for it, routes in forced:
        if routes is not None:  # positions [it.start, it.end) of this chunk meet the forced [routes.start, end)
            lo, hi = max(it.start, routes.start), min(it.end, routes.end)
            if hi > lo:
                r0 = row + lo - it.start
                ids[r0 : r0 + hi - lo] = routes.ids[lo - routes.start : hi - routes.start]
                mask[r0 : r0 + hi - lo] = True
        row += it.extend_len
    if stage is None:
        return ReplayPlan(topk_ids=torch.from_numpy(ids).to(device), row_mask=torch.from_numpy(mask).to(device))
    return ReplayPlan(topk_ids=stage(ids).view(ids.shape), row_mask=stage(mask))
