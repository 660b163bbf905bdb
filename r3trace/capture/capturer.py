"""RoutedExpertsCapturer: per-token, per-MoE-layer top-k ids from the routing op to the client.

Shape legend: T tokens in a forward, S KV slots, L num_hidden_layers, M MoE layers, K top-k.
Row p of a request is the routing of input position p (the routing that produced token p+1), as in
SGLang's wire format. What SGLang gets wrong and this gets right, each covered by a test:
- sizing comes from constructor arguments, and a configuration that could overflow is refused here;
- only rows of requests that asked (or every row while a trace sink records) are copied to the host, read at
  the batch's explicit row range (`route_rows`: a DP rank's rows of the gathered batch), never at [0, T);
- rows live in a host buffer indexed by KV slot, so prefix-cache hits and chunked prefill are exact;
- a prefill-only request (max_new_tokens = 0) returns every prompt row;
- dense layers are -1 on the wire, never 0 ("expert 0");
- on retraction a request's rows are kept before its KV is freed, and the re-prefill never replaces
  them (mismatching recomputed ids are counted in `recompute_mismatches`).
While a trace records, drained rows go to its TraceSink (sink.py).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .buffers import PendingCopy, RouteBuffers
from .config import CaptureConfig
from .config import CaptureConfigError as CaptureConfigError  # re-exported: callers import it from here
from .physical import PhysicalIds
from .recorder import BatchView
from .route_rows import RequestState, RouteRows, expand_layers, join_rows
from .sink import TraceSink as TraceSink  # re-exported: the protocol a trace writer satisfies
from .sink import emit_computed, emit_prefix


class RoutedExpertsCapturer:
    def __init__(self, cfg: CaptureConfig) -> None:
        self.cfg = cfg
        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layer_ids)}
        self.buffers = RouteBuffers(
            cfg.max_batch_tokens, cfg.kv_slots, len(cfg.moe_layer_ids), cfg.top_k, cfg.num_experts, cfg.device,
            cfg.with_weights,
        )
        # the physical slot of each pair, moved in lockstep with self.buffers (physical.py); None: not kept
        self.physical = None if not cfg.physical_slots else PhysicalIds(
            cfg.max_batch_tokens, cfg.kv_slots, len(cfg.moe_layer_ids), cfg.top_k, cfg.physical_slots, cfg.device)
        self.requests: dict[str, RequestState] = {}
        self.sink: TraceSink | None = None
        self.recompute_mismatches = 0  # rows whose re-prefill after retraction routed differently
        self._batch_tokens = 0
        self._dp_rank = 0

    # ---------------------------------------------------------------- RouteRecorder
    def on_forward_begin(self, batch: BatchView) -> None:
        self._dp_rank = batch.dp_rank  # a capturer serves one rank: prefix-cache rows carry it too
        self._batch_tokens = batch.num_tokens
        self.buffers.before_forward()
        if self.physical is not None:
            self.physical.buffers.before_forward()

    def route_buffer(self, layer_id: int, num_tokens: int, row0: int = 0) -> torch.Tensor | None:
        return self.buffers.ids_view(self.moe_index[layer_id], num_tokens, row0)

    def capture(self, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                row0: int = 0) -> None:
        self.buffers.write(self.moe_index[layer_id], topk_ids, topk_weights, row0)

    def capture_physical(self, layer_id: int, topk_ids: torch.Tensor, row0: int = 0) -> None:
        """[T, K] physical slots of the routed batch (physical.PhysicalRecorder); ignored when not kept."""
        if self.physical is not None:
            self.physical.buffers.write(self.moe_index[layer_id], topk_ids, None, row0)

    def on_forward_end(self, batch: BatchView) -> None:
        if batch.out_cache_loc_cpu is not None:  # host bookkeeping: which forward owns each slot's KV now
            self.buffers.claim(batch.out_cache_loc_cpu, batch.forward_id)
            if self.physical is not None:
                self.physical.buffers.claim(batch.out_cache_loc_cpu, batch.forward_id)
        entries: list[tuple[str, int, int, int, str]] = []
        spans: list[tuple[int, int]] = []  # (first of this rank's rows, n) of each wanted request
        start = copied = 0
        everyone = self.sink is not None
        for rid, n, prefix, phase in zip(
            batch.request_ids, batch.extend_lens_cpu, batch.prefix_lens_cpu, batch.phases, strict=True
        ):
            state = self.requests.get(rid)
            if phase == "verify" and state is not None:
                state.verify_from = min(state.verify_from, prefix)
            if everyone or (state is not None and state.want):
                entries.append((rid, copied, n, prefix, phase))
                spans.append((start, n))
                copied += n
            start += n
        if not copied:
            self.buffers.bytes_last_step = 0  # nobody asked: nothing crosses to the host
            return
        own = batch.route_rows  # this rank's rows of the routed batch: the device rows the copy reads
        if own.length != start:
            raise RuntimeError(f"route capture: batch.route_rows={own} but the requests have {start} rows")
        pending = PendingCopy(
            forward_id=batch.forward_id, ts_ns=time.time_ns(), dp_rank=batch.dp_rank, n_rows=0,
            ids=self.buffers.dev_ids, weights=None, slots=batch.out_cache_loc, entries=entries,
            claim_slots=batch.out_cache_loc_cpu is None,
        )
        if self.buffers.full:
            # Both staging sets in flight: the oldest belongs to a forward whose sampled tokens the
            # engine already read, so it is complete and this costs no wait on the device.
            self._process(self._drain_one())
        rows = None if copied == start else [r for s0, n in spans for r in range(s0, s0 + n)]
        self.buffers.start_copy(rows, own, batch.out_cache_loc, pending, batch.out_cache_loc_cpu)
        if self.physical is not None:
            self.physical.start_copy(pending, rows, batch)

    # ---------------------------------------------------------------- request lifecycle
    def add_request(self, rid: str, want: bool) -> None:
        self.requests[rid] = RequestState(want=want)

    def on_admit(self, rid: str, cached_len: int, prefix_slots: np.ndarray) -> None:
        """After prefix matching: positions < cached_len reuse KV (and routes) another forward wrote."""
        state = self.requests[rid]
        state.cached_len = cached_len
        if state.first_cached_len < 0:
            state.first_cached_len = cached_len
        state.prefix_slots = np.asarray(prefix_slots, dtype=np.int64)[:cached_len]
        if self.sink is not None and state.sink_emitted < cached_len:
            self.drain()
            emit_prefix(self.sink, self.buffers, None if self.physical is None else self.physical.buffers, rid, state,
                        self._dp_rank)

    def usable_prefix(self, rid: str, slots: np.ndarray) -> int:
        """Leading positions of a prefix-cache match whose routes are on the host (all of them when
        the request does not capture). A capturing request recomputes the rest instead of returning
        rows nobody copied."""
        state = self.requests.get(rid)
        if self.sink is None and (state is None or not state.want):
            return len(slots)
        return self.host_prefix(slots)

    def host_prefix(self, slots: np.ndarray) -> int:
        """How many leading slots hold host routes of the KV currently in them."""
        self.drain_for(slots)
        return self.buffers.valid_prefix(np.asarray(slots, dtype=np.int64))

    def on_retract(self, rid: str, slots: np.ndarray) -> None:
        """Before the request's KV is freed: keep the rows of its computed positions (slots [n])."""
        state = self.requests.get(rid)
        if state is None or not (state.want or self.sink is not None):
            return
        self.drain()
        fresh = np.asarray(slots)[state.n_kept :]
        if len(fresh):
            physical = None if self.physical is None else self.physical.buffers.read(fresh)
            state.keep(self.buffers.read(fresh), self.buffers.read_weights(fresh), physical)

    def on_reject(self, rid: str, start: int, kept: int, slots: np.ndarray) -> None:
        """A verify forward computed positions start.. of rid; all but the first `kept` were rejected (slots: their KV
        slots). Their rows leave the copy in flight before it reaches the sink and the slots' host rows turn invalid,
        so no response, stream chunk or trace holds them. Called before anything drains that copy."""
        if not len(slots):
            return
        slots = np.asarray(slots, dtype=np.int64)
        trimmed = self.buffers.reject(rid, start, kept, slots)
        if self.physical is not None:
            self.physical.buffers.release(slots)
        state = self.requests.get(rid)
        if not trimmed and state is not None and state.sink_emitted > start + kept:
            raise RuntimeError(f"route capture: rows {start + kept}.. of {rid} reached the trace before the verify "
                               "forward that computed them was accepted")

    def rows(self, rid: str, slots: np.ndarray, start: int, end: int) -> RouteRows:
        """Rows of positions [start, end), slots: KV slot of every position 0..end-1 (host)."""
        self.drain_for(np.asarray(slots)[start:end])
        state = self._state(rid)
        moe = self._read(state, np.asarray(slots, dtype=np.int64), start, end, weights=False)
        weights = self._read(state, np.asarray(slots, dtype=np.int64), start, end, weights=True)
        assert moe is not None  # ids always exist; only weights may be absent
        physical = None
        if self.physical is not None:
            physical = self._expand(self.physical.read(np.asarray(slots, dtype=np.int64), state.kept_physical,
                                                       start, end), -1)
        return RouteRows(
            offset=start, ids=self._expand(moe, -1), weights=None if weights is None else self._expand(weights, 0),
            physical=physical,
        )

    def stream_rows(self, rid: str, slots: np.ndarray, start_len: int, end: int) -> RouteRows:
        """Rows added since the previous call (never before start_len)."""
        state = self._state(rid)
        begin = max(state.stream_emitted, start_len)
        out = self.rows(rid, slots, begin, max(begin, end))
        state.stream_emitted = max(begin, end)
        return out

    def provenance(self, rid: str, prompt_len: int, start: int, end: int) -> list[tuple[int, int, str, str]]:
        """Run-length provenance of rows [start, end): (first, last + 1, phase, source) segments."""
        return self._state(rid).provenance(prompt_len, start, end)

    def finish_request(self, rid: str) -> None:
        self.requests.pop(rid, None)

    # ---------------------------------------------------------------- sink
    def attach_sink(self, sink: TraceSink) -> None:
        self.drain()
        self.sink = sink

    def detach_sink(self) -> TraceSink | None:
        self.drain()
        sink, self.sink = self.sink, None
        return sink

    # ---------------------------------------------------------------- internals
    def _state(self, rid: str) -> RequestState:
        """A request that finished before it was ever admitted (aborted while waiting) has no rows."""
        state = self.requests.get(rid)
        return state if state is not None else RequestState(want=False)

    @property
    def bytes_last_step(self) -> int:
        return self.buffers.bytes_last_step

    @property
    def bytes_total(self) -> int:
        return self.buffers.bytes_total

    def drain(self) -> None:
        """Scatter every finished copy into the host buffer (FIFO) and feed the sink."""
        while self.buffers.pending:
            self._process(self._drain_one())

    def drain_for(self, slots: np.ndarray) -> None:
        """Drain (FIFO) up to the newest forward that wrote one of these slots' KV, and no further: a later
        forward may still be running (the overlapped scheduler's step ahead), and waiting for its copy would
        stall the host on the GPU for a row nobody asked for."""
        pending = self.buffers.pending
        if any(p.claim_slots for p in pending):  # ownership known only once drained: drain everything
            self.drain()
            return
        slots = np.asarray(slots, dtype=np.int64)
        newest = int(self.buffers.kv_forward[slots].max()) if len(slots) else -1
        while pending and pending[0].forward_id <= newest:
            self._process(self._drain_one())

    def _drain_one(self) -> PendingCopy:
        """The oldest copy, and its physical twin (started together, so drained together) as its `physical`."""
        twin = None if self.physical is None else self.physical.buffers.drain_one()
        p = self.buffers.drain_one()
        if twin is not None:
            p.physical = twin.ids
        return p

    def _process(self, p: PendingCopy) -> None:
        """A copy that reached the host: count re-prefill mismatches and feed the sink (one call per forward)."""
        ids = p.ids.numpy()
        emit: list[tuple[str, int, int, int, str]] = []  # (rid, first row in p, end row, first position, phase)
        for rid, row0, n, prefix, phase in p.entries:
            state = self.requests.get(rid)
            if state is not None and state.kept is not None and prefix < len(state.kept):
                m = min(n, len(state.kept) - prefix)
                fresh = ids[row0 : row0 + m].astype(np.int32)
                self.recompute_mismatches += int((fresh != state.kept[prefix : prefix + m]).any(axis=(1, 2)).sum())
            if self.sink is not None and state is not None:
                skip = max(0, state.sink_emitted - prefix)  # positions kept from before a retraction
                if skip < n:
                    emit.append((rid, row0 + skip, row0 + n, prefix + skip, phase))
                    state.sink_emitted = prefix + n
        if emit:
            assert self.sink is not None
            emit_computed(self.sink, p, ids, emit)

    def _read(self, state: RequestState, slots: np.ndarray, start: int, end: int, weights: bool) -> np.ndarray | None:
        """[end - start, M, K] ids (or weights: None when the host does not keep them) of positions [start, end)."""
        if weights and self.buffers.host_weights is None:
            return None
        empty = np.zeros((0, len(self.cfg.moe_layer_ids), self.cfg.top_k), np.float16 if weights else np.int32)
        if weights:
            return join_rows(state.kept_weights, self.buffers.read_weights, slots, start, end, empty)
        return join_rows(state.kept, self.buffers.read, slots, start, end, empty)

    def _expand(self, moe_rows: np.ndarray, fill: float) -> np.ndarray:
        return expand_layers(moe_rows, fill, self.cfg.moe_layer_ids, self.cfg.num_hidden_layers)
