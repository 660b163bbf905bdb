"""The engine side of route capture and routing replay.

RouteCaptureHooks is the scheduler's RequestHooks: it tells the capturer when a request is admitted
(prefix hit), retracted (keep its rows before the KV is freed) and finished (assemble its rows while
the KV is still valid). Per-request capture options live in `req.extras["capture"]`; forced routes for
replay in `req.extras["replay"]`. Shape legend: L num_hidden_layers, K top-k, E routed experts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from r3trace.capture.capturer import RoutedExpertsCapturer, RouteRows
from r3trace.capture.wire import WireFormatError, decode_array, encode_float16, encode_int32

from .config import ModelConfig
from .forward_batch import ReplayPlan
from .kv_pool import KVPool
from .request import InvalidRequestError, Req
from .step import ScheduledReq


@dataclass
class CaptureRequest:
    """A request's capture options (req.extras["capture"])."""

    want: bool
    start_len: int = 0
    weights: bool = False
    tag: str | None = None
    arrival_ns: int = 0
    rows: RouteRows | None = None  # assembled at finish, before the KV is freed
    provenance: list[tuple[int, int, str, str]] = field(default_factory=list)


class TeeSink:
    """Rows to the Parquet writer and, as they are captured, to an Arrow IPC stream."""

    def __init__(self, writer: Any, stream: Any) -> None:
        self.writer = writer
        self.stream = stream

    def append_tokens(self, *args: Any, **kwargs: Any) -> None:
        self.writer.append_tokens(*args, **kwargs)
        self.stream.append_tokens(*args, **kwargs)


class RouteCaptureHooks:
    def __init__(self, capturer: RoutedExpertsCapturer, pool: KVPool) -> None:
        self.capturer = capturer
        self.pool = pool
        self.writer: Any = None  # the active TraceWriter, if a trace is being recorded
        # [S + 1] bool: the KV in slot s was computed with forced routes (routing replay). Set for a finished
        # request's computed positions before its pages can enter the prefix cache; read on every match.
        self.forced_kv = np.zeros(pool.num_tokens + 1, bool)

    def register(self, req: Req) -> None:
        opts: CaptureRequest | None = req.extras.get("capture")
        self.capturer.add_request(req.rid, want=bool(opts and opts.want))

    def prefer_pages(self, cached: np.ndarray, own: np.ndarray) -> bool:
        """Cache the finished request's copy of a prefix when it routed freely and the cached one did not, or,
        as forced as the cached copy, when only its routes are on the host."""
        cached_forced, own_forced = bool(self.forced_kv[cached].any()), bool(self.forced_kv[own].any())
        if cached_forced != own_forced:
            return cached_forced
        return self.capturer.host_prefix(cached) < len(cached) and self.capturer.host_prefix(own) == len(own)

    def usable_prefix(self, req: Req, slots: np.ndarray) -> int:
        """Of a prefix-cache match, the leading positions whose reuse gives what the request would compute:
        position p is exact when every position before it is and, if the request forces p, the routes the
        cached KV was computed with (on the host) are the forced ids in order, else the cached KV was computed
        with the gate's own routes. A request that routes freely so never reuses KV computed with forced
        routes; a replay reuses natural KV where its routes agree. Routes not on the host (nobody captured
        them) count as different: the rest is recomputed."""
        if req.rid not in self.capturer.requests:
            self.register(req)
        n = self.capturer.usable_prefix(req.rid, slots)
        replay: ReplayRoutes | None = req.extras.get("replay")
        lo, hi = (0, 0) if replay is None else (min(replay.start, n), min(replay.end, n))
        ok = ~self.forced_kv[slots[:n]]  # [n]: unforced positions
        if hi > lo:
            have = self.capturer.host_prefix(slots[lo:hi])
            cached = self.capturer.buffers.read(slots[lo : lo + have])  # [have, M, K]
            forced = replay.ids[lo - replay.start : lo - replay.start + have][:, list(self.capturer.cfg.moe_layer_ids)]
            ok[lo:hi] = False
            ok[lo : lo + have] = (cached == forced).all(axis=(1, 2))
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if len(bad) else n

    def on_admit(self, req: Req) -> None:
        if req.rid not in self.capturer.requests:
            self.register(req)
        slots = self.pool.slots(req.pages, 0, req.kv_len)
        self.capturer.on_admit(req.rid, req.cached_len, slots)

    def on_retract(self, req: Req) -> None:
        self.capturer.on_retract(req.rid, self.pool.slots(req.pages, 0, req.kv_len))

    def on_finish(self, req: Req) -> None:
        self._mark_forced(req)
        opts: CaptureRequest | None = req.extras.get("capture")
        want = opts is not None and opts.want
        n_rows = req.kv_len if req.pool_row >= 0 else 0
        needed = n_rows and (want or self.writer is not None)  # most finishes capture nothing: no slot list
        slots = self.pool.slots(req.pages, 0, n_rows) if needed else np.zeros(0, np.int64)
        if opts is not None and opts.want:
            if req.stream:  # what the stream has not carried yet
                opts.rows = self.capturer.stream_rows(req.rid, slots, opts.start_len, n_rows)
            else:
                start = min(opts.start_len, n_rows)
                opts.rows = self.capturer.rows(req.rid, slots, start, max(start, n_rows))
            opts.provenance = self.capturer.provenance(req.rid, req.prompt_len, opts.rows.offset, n_rows)
        if self.writer is not None:  # the request's rows reach the sink before its summary
            self.capturer.drain_for(slots)
            self.writer.add_request(
                req.rid, tag=None if opts is None else opts.tag, prompt_tokens=req.prompt_len,
                completion_tokens=len(req.output_ids),
                finish_reason=None if req.finish is None else req.finish.type,
                arrival_ts=None if opts is None else opts.arrival_ns, finish_ts=time.time_ns(),
                token_ids=req.fill_ids,
            )
        self.capturer.finish_request(req.rid)

    def _mark_forced(self, req: Req) -> None:
        """Before the pages can enter the prefix cache: which of the positions this request computed (those
        past its reused prefix) had forced routes."""
        if req.pool_row < 0 or req.kv_len <= req.cached_len:
            return
        slots = self.pool.slots(req.pages, req.cached_len, req.kv_len)
        self.forced_kv[slots] = False
        replay: ReplayRoutes | None = req.extras.get("replay")
        if replay is not None:
            lo, hi = max(replay.start, req.cached_len), min(replay.end, req.kv_len)
            if hi > lo:
                self.forced_kv[slots[lo - req.cached_len : hi - req.cached_len]] = True

    def stream_rows(self, req: Req) -> RouteRows | None:
        """Rows computed since the previous chunk of a running streaming request."""
        opts: CaptureRequest | None = req.extras.get("capture")
        if opts is None or not opts.want or req.finished:
            return None
        n = req.computed_len  # not kv_len: a step launched ahead holds a position whose row is still on the GPU
        return self.capturer.stream_rows(req.rid, self.pool.slots(req.pages, 0, n), opts.start_len, n)


def route_meta(rows: RouteRows, cfg: ModelConfig, with_weights: bool, delta: bool) -> dict[str, Any]:
    """meta_info fields for a block of rows: SGLang's base64 plus the shape, dtype and layer ids."""
    meta: dict[str, Any] = {
        "routed_experts": encode_int32(rows.ids),
        "routed_experts_shape": list(rows.ids.shape),
        "routed_experts_dtype": "int32",
        "moe_layer_ids": list(cfg.moe_layer_ids),
    }
    if delta:
        meta["routed_experts_offset"] = rows.offset
    if with_weights and rows.weights is not None:
        meta["routed_weights"] = encode_float16(rows.weights)
        meta["routed_weights_shape"] = list(rows.weights.shape)
        meta["routed_weights_dtype"] = "float16"
    return meta


@dataclass(frozen=True)
class ReplayRoutes:
    """A request's forced routes (req.extras["replay"]): ids [n, L, K] int32 for positions [start, start + n).

    Row i forces position start + i: its ids on every MoE layer, with weights the gate's own scores at
    those ids (engine/layers/router.py). docs/replay.md states the contract."""

    ids: np.ndarray
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


class ComputedRows(NamedTuple):
    """The positions a request forwards: [0, count); `why` spells the count out for error messages."""

    count: int
    limit: int  # rows a replay may give: count, + 1 for the last sampled token's (never forwarded, ignored)
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


def replay_routes(
    value: Any, start: Any, cfg: ModelConfig, rows: ComputedRows
) -> ReplayRoutes:
    """Parse and check one request's forced routes against the rows it computes.

    start None (full replay): the routes must cover every computed row [0, rows.count). start s (partial
    replay): the n rows given force positions [s, s + n), which must lie inside the request."""
    name, start_name = "routed_experts", "routed_experts_replay_start_len"
    ids = parse_replay(value, cfg)
    n = len(ids)
    if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
        raise InvalidRequestError(start_name, f"{start!r} must be an integer >= 0 (or null for a full replay)")
    if n == 0:
        raise InvalidRequestError(
            name, f"0 rows given (empty); this request computes {rows.count} ({rows.why}); omit routed_experts "
            "to route freely"
        )
    if start is None and n < rows.count:
        fewer = ", lower max_new_tokens" if n >= rows.prompt_len else ""
        raise InvalidRequestError(
            name, f"{n} rows given, this request computes {rows.count} ({rows.why}); give all {rows.count}{fewer}, "
            f"or pass {start_name} to force only rows [start, start + {n}) (partial replay)"
        )
    first = 0 if start is None else start
    if first + n > rows.limit:
        where = f"rows [{first}, {first + n})" if start is not None else f"{n} rows"
        raise InvalidRequestError(
            name, f"{where} given; this request computes {rows.count} ({rows.why}), rows [0, {rows.limit}) at most"
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
    con = duckdb.connect()
    glob = str(root / "**" / "part-*.parquet")
    rows = con.execute(
        f"SELECT token_pos, layer_id, topk_ids FROM read_parquet('{glob}', hive_partitioning=true) "
        "WHERE request_id = ? AND (? IS NULL OR run_id = ?) ORDER BY token_pos, layer_id",
        [rid, ref.get("run_id"), ref.get("run_id")],
    ).fetchall()
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
    forced = [(it, it.req.extras.get("replay")) for it in items]
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
