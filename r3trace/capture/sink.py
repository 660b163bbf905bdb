"""TraceSink: what route capture feeds while a trace records, and the two ways rows reach it.

Shape legend: T rows of one call, M MoE layers, K top-k.
- emit_prefix: the rows a request reused from the prefix cache (source "prefix_cache"), read from the host buffer by
  KV slot, each with the forward that computed it;
- emit_computed: every request's new rows of one drained copy (source "computed"), in one call.
The capturer decides which rows (what a request has not emitted yet, never a rejected verify row: they left the copy
before it drained) and calls these; r3trace.trace.writer.TraceWriter is the sink in use.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from r3trace.trace.schema import PHASES

from .buffers import PendingCopy, RouteBuffers
from .route_rows import RequestState


class TraceSink(Protocol):
    """What the capturer needs of a trace writer (r3trace.trace.writer.TraceWriter satisfies it)."""

    def append_tokens(
        self, request_id: Any, token_pos: Any, phase: Any, source: Any, forward_id: Any, ts: Any, dp_rank: Any,
        topk_ids: np.ndarray, topk_weights: np.ndarray | None = None, physical_ids: np.ndarray | None = None,
    ) -> None: ...


def emit_prefix(sink: TraceSink, buffers: RouteBuffers, physical: RouteBuffers | None, rid: str,
                state: RequestState, dp_rank: int) -> None:
    """Positions state.sink_emitted .. state.cached_len of rid, reused from the prefix cache: their host rows."""
    lo, hi = state.sink_emitted, state.cached_len
    slots = state.prefix_slots[lo:hi]
    ids, w = buffers.read(slots), buffers.read_weights(slots)
    # forward_id: the earlier forward that computed these KV slots (and their routes).
    forward_ids = buffers.forwards_of(slots)
    # the keyword only when kept: a sink that records no physical ids need not know it
    extra = {} if physical is None else {"physical_ids": physical.read(slots)}
    sink.append_tokens(
        [rid] * (hi - lo), np.arange(lo, hi, dtype=np.int32), "prefill", "prefix_cache", forward_ids,
        time.time_ns(), dp_rank, ids, w, **extra,
    )
    state.sink_emitted = hi


def emit_computed(sink: TraceSink, p: PendingCopy, ids: np.ndarray, emit: list[tuple[str, int, int, int, str]]) -> None:
    """Every request's new rows of one forward in one sink call: at decode batch 64 that is one call of 64 tokens
    instead of 64 calls of one (the writer's per-call cost dominated: 20x the host time a step).
    ids: [n, M, K] the copy's rows; emit: (request_id, first row, end row, first position, phase) per request."""
    lens = np.array([hi - lo for _, lo, hi, _, _ in emit])
    rows = np.concatenate([np.arange(lo, hi) for _, lo, hi, _, _ in emit])  # [T] rows of this copy
    pos = np.concatenate([np.arange(first, first + hi - lo, dtype=np.int32) for _, lo, hi, first, _ in emit])
    rids = [rid for (rid, *_), n in zip(emit, lens.tolist(), strict=True) for _ in range(n)]
    phases = np.repeat(np.array([PHASES.index(ph) for *_, ph in emit], np.int32), lens)
    extra = {} if p.physical is None else {"physical_ids": p.physical.numpy()[rows].astype(np.int32)}
    sink.append_tokens(
        rids, pos, phases, "computed", p.forward_id, p.ts_ns, p.dp_rank, ids[rows].astype(np.int32, copy=False),
        None if p.weights is None else p.weights.numpy()[rows], **extra,
    )
