"""The engine side of route capture and routing replay.

RouteCaptureHooks is the scheduler's RequestHooks: it tells the capturer when a request is admitted
(prefix hit), retracted (keep its rows before the KV is freed) and finished (assemble its rows while
the KV is still valid), and decides which prefix-cache hits a replay may reuse. Per-request capture
options are `req.capture`; forced routes for replay `req.replay` (engine/route_options.py).
Shape legend: L num_hidden_layers, K top-k, E routed experts.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from r3trace.capture.capturer import RoutedExpertsCapturer
from r3trace.capture.route_rows import RouteRows
from r3trace.capture.wire import encode_float16, encode_int32

from .kv_pool import KVPool
from .model_config import ModelConfig
from .request import Req


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
        self.any_forced = False  # until a replay computes a position, every flag is False: nothing to read or clear

    def register(self, req: Req) -> None:
        opts = req.capture
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
        replay = req.replay
        if replay is None and not self.any_forced:
            return n
        ok = ~self.forced_kv[slots[:n]]  # [n]: unforced positions
        lo, hi = (0, 0) if replay is None else (min(replay.start, n), min(replay.end, n))
        if replay is not None and hi > lo:
            have = self.capturer.host_prefix(slots[lo:hi])
            cached = self.capturer.buffers.read(slots[lo : lo + have])  # [have, M, K]
            first = lo - replay.start
            forced = replay.ids[first : first + have][:, list(self.capturer.cfg.moe_layer_ids)]  # [have, M, K]
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

    def on_reject(self, req: Req, start: int, kept: int, slots: np.ndarray) -> None:
        self.capturer.on_reject(req.rid, start, kept, slots)

    def on_finish(self, req: Req) -> None:
        self._mark_forced(req)
        opts = req.capture
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
        replay = req.replay
        if (replay is None and not self.any_forced) or req.pool_row < 0 or req.kv_len <= req.cached_len:
            return  # (most finishes: no slot list)
        slots = self.pool.slots(req.pages, req.cached_len, req.kv_len)
        self.forced_kv[slots] = False
        if replay is not None:
            lo, hi = max(replay.start, req.cached_len), min(replay.end, req.kv_len)
            if hi > lo:
                self.forced_kv[slots[lo - req.cached_len : hi - req.cached_len]] = True
                self.any_forced = True

    def stream_rows(self, req: Req) -> RouteRows | None:
        """Rows computed since the previous chunk of a running streaming request."""
        opts = req.capture
        if opts is None or not opts.want or req.finished:
            return None
        n = req.computed_len  # not kv_len: a step launched ahead holds a position whose row is still on the GPU
        return self.capturer.stream_rows(req.rid, self.pool.slots(req.pages, 0, n), opts.start_len, n)


def route_meta(rows: RouteRows, cfg: ModelConfig, with_weights: bool, delta: bool, start_len: int) -> dict[str, Any]:
    """meta_info fields for a block of rows: SGLang's base64 plus the shape, dtype and layer ids, and the
    request's routed_experts_start_len echoed back (slime appends a later turn's rows at that position)."""
    meta: dict[str, Any] = {
        "routed_experts": encode_int32(rows.ids),
        "routed_experts_start_len": start_len,
        "routed_experts_shape": list(rows.ids.shape),
        "routed_experts_dtype": "int32",
        "moe_layer_ids": list(cfg.moe_layer_ids),
    }
    if delta:
        meta["routed_experts_offset"] = rows.offset
    if rows.physical is not None:  # EngineConfig.capture_physical_ids: the slot that computed each pair
        meta["routed_experts_physical"] = encode_int32(rows.physical)
        meta["routed_experts_physical_shape"] = list(rows.physical.shape)
        meta["routed_experts_physical_dtype"] = "int32"
    if with_weights and rows.weights is not None:
        meta["routed_weights"] = encode_float16(rows.weights)
        meta["routed_weights_shape"] = list(rows.weights.shape)
        meta["routed_weights_dtype"] = "float16"
    return meta
