"""Device and host route buffers, and the asynchronous copy between them.

Shape legend: R device rows (max tokens one routed batch may have: under DP attention the batch gathered
from every DP rank), S KV slots, M MoE layers, K top-k.
- device buffer [M, R, K] int32: layer-major, so one layer's rows [:T] are a contiguous [T, K] block the
  fused top-k kernel writes its ids into directly (the MoE then reads them from there): capture costs no
  kernel of its own; other top-k backends copy into it with a slice assignment. No host sync, a static
  address, so it also works inside a CUDA graph;
- host buffer [S, M, K]: indexed by KV slot (`out_cache_loc`), so a token's route lives exactly as long
  as its KV: prefix-cache hits and chunked prefill come out right by construction;
- after each forward, only the rows somebody asked for are gathered on the device and copied into a
  pinned staging buffer with non_blocking=True, on a side stream: the engine's wait for its sampled
  tokens does not wait for the copy (serialised behind the forward it cost ~20 us of device time and
  a launch chain a step, 0.2 ms of a 13.5 ms batch-1 step with 58 MoE layers on the H200), and the next
  forward waits for the copy on the device (never on the host) before it overwrites the buffer. An
  event marks completion and the rows are scattered into the host buffer by slot when the engine next
  needs them (FIFO, so a reused slot always ends with the newest route).
Ids cross to the host as int16 when E <= 32767 (half the bytes of int32); -1 marks "no route".
Host-side arrays are numpy: on our 2-core CPU, torch's CPU kernels took 3.3 ms to scatter 256 rows of
58 x 8 int16 ids by slot and 7 ms to copy them, numpy 13 us and 8 us (torch 2.13).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .recorder import RowRange


def id_dtype(num_experts: int) -> torch.dtype:
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


@dataclass
class PendingCopy:
    """One forward's rows in flight to the host. Entries: (request_id, first staging row, n, first pos)."""

    forward_id: int
    ts_ns: int
    dp_rank: int
    n_rows: int
    ids: torch.Tensor  # staging view [n, M, K]
    weights: torch.Tensor | None  # staging view [n, M, K] float16
    slots: torch.Tensor  # staging view [n] int64
    entries: list[tuple[str, int, int, int, str]] = field(default_factory=list)  # + phase
    event: torch.cuda.Event | None = None
    # The batch had no host copy of its slots: record KV ownership from the staged slots at drain time.
    claim_slots: bool = False
    # The physical twin's staging view [n, M, K] (physical.py), the same rows as ids; set when both are drained.
    physical: torch.Tensor | None = None


class RouteBuffers:
    def __init__(
        self,
        device_rows: int,
        host_slots: int,
        num_moe_layers: int,
        top_k: int,
        num_experts: int,
        device: torch.device | str,
        with_weights: bool,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = id_dtype(num_experts)  # host dtype
        self.on_cuda = self.device.type == "cuda"
        shape = (device_rows, num_moe_layers, top_k)
        dev_shape = (num_moe_layers, device_rows, top_k)
        self.dev_ids = torch.full(dev_shape, -1, dtype=torch.int32, device=self.device)
        self.dev_weights = (
            torch.zeros(dev_shape, dtype=torch.float16, device=self.device) if with_weights else None
        )
        pin = self.on_cuda
        np_ids = np.int16 if self.dtype == torch.int16 else np.int32
        self.host_ids = np.full((host_slots, num_moe_layers, top_k), -1, dtype=np_ids)
        self.host_weights = (
            np.zeros((host_slots, num_moe_layers, top_k), dtype=np.float16) if with_weights else None
        )
        # Which forward last wrote each slot's KV, and which forward's routes host_ids holds for it: the
        # host row of a slot is valid only when the two agree (rows of requests that did not ask for
        # routes are never copied, and a freed slot is soon rewritten by another request).
        self.kv_forward = np.full(host_slots, -1, dtype=np.int64)
        self.rows_forward = np.full(host_slots, -1, dtype=np.int64)
        # Two staging sets: forward k+1 can be captured while forward k's copy is still in flight.
        self._staging = [self._alloc_staging(shape, self.dtype, pin, with_weights) for _ in range(2)]
        self._next_staging = 0
        self.pending: deque[PendingCopy] = deque()
        self._copy_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self._last_copy: torch.cuda.Event | None = None  # the newest copy still reading dev_ids
        # Per step on CUDA, no allocation and no event creation (each a few us of host time; the bundled sample
        # model's decode step is host-bound: 0.79 ms a step against a 0.23 ms graph replay on the H200, capture
        # adding ~0.2 ms of host work): the token-major source of the pinned copy is one device buffer (the copy
        # stream orders a step's write after the previous step's read), one event a staging set.
        self._dev_major = (
            (torch.empty(shape, dtype=self.dtype, device=self.device),
             torch.empty(shape, dtype=torch.float16, device=self.device) if with_weights else None)
            if self.on_cuda else None
        )  # fmt: skip
        self._events = [torch.cuda.Event() for _ in self._staging] if self.on_cuda else []
        self.bytes_last_step = 0
        self.bytes_total = 0

    @staticmethod
    def _alloc_staging(
        shape: tuple[int, int, int], dtype: torch.dtype, pin: bool, with_weights: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        ids = torch.empty(shape, dtype=dtype, pin_memory=pin)
        weights = torch.empty(shape, dtype=torch.float16, pin_memory=pin) if with_weights else None
        slots = torch.empty(shape[0], dtype=torch.int64, pin_memory=pin)
        return ids, weights, slots

    def ids_view(self, moe_index: int, t: int, row0: int = 0) -> torch.Tensor:
        """The routed batch's t rows of one MoE layer, from buffer row row0: a contiguous int32 [t, K] block a
        top-k kernel may write into. Which of them are this rank's is the batch's route_rows."""
        if row0 + t > self.dev_ids.shape[1]:
            raise RuntimeError(
                f"route capture: forward of {t} tokens from row {row0} exceeds the device buffer of "
                f"{self.dev_ids.shape[1]} rows"
            )
        return self.dev_ids[moe_index, row0 : row0 + t]

    def before_forward(self) -> None:
        """The next forward rewrites dev_ids: order it after the copy that reads them (a device-side wait)."""
        if self._last_copy is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_copy)
            self._last_copy = None

    def write(self, moe_index: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None, row0: int = 0) -> None:
        """Called from the routing op: the routed batch's topk_ids [N, K] -> its rows of one MoE layer from buffer
        row row0 (no copy when the top-k kernel already wrote them there)."""
        n = topk_ids.shape[0]
        dst = self.ids_view(moe_index, n, row0)
        if dst.data_ptr() != topk_ids.data_ptr():
            dst.copy_(topk_ids)
        if self.dev_weights is not None and topk_weights is not None:
            self.dev_weights[moe_index, row0 : row0 + n].copy_(topk_weights)

    def start_copy(
        self,
        rows: list[int] | None,
        own: RowRange,
        out_cache_loc: torch.Tensor,
        pending: PendingCopy,
        host_slots: np.ndarray | None = None,
    ) -> None:
        """Gather `rows` of this rank's own.length tokens (None: all of them) on the device and copy them to pinned
        staging, async. own: where those tokens sit in dev_ids (a DP rank's rows of the gathered batch); rows and
        out_cache_loc count from own.start. host_slots: the batch's out_cache_loc on the host (the engine has it),
        which then needs no copy back."""
        n_tokens, first = own.length, own.start
        if self.full:
            raise RuntimeError("route capture: every staging buffer is in flight; drain_one() first")
        which = self._next_staging
        ids_st, w_st, slots_st = self._staging[which]
        self._next_staging = (self._next_staging + 1) % len(self._staging)
        if not self.on_cuda:  # host tensors already: no staging, no copy engine
            self._start_copy_host(rows, own, out_cache_loc, pending)
            return
        assert self._copy_stream is not None and self._dev_major is not None
        stream = self._copy_stream
        major_ids, major_w = self._dev_major
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward has written its ids
        n = n_tokens if rows is None else len(rows)
        pending.slots = slots_st[:n]
        if host_slots is not None:
            np.copyto(pending.slots.numpy(), host_slots[:n] if rows is None else host_slots[rows])
        with torch.cuda.stream(stream):
            if rows is None:
                src_ids = self.dev_ids[:, first : first + n]
                src_w = None if self.dev_weights is None else self.dev_weights[:, first : first + n]
            else:
                index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
                dev_index = index + first if first else index
                src_ids = self.dev_ids.index_select(1, dev_index)
                src_w = None if self.dev_weights is None else self.dev_weights.index_select(1, dev_index)
            # [M, n, K] -> [n, M, K] in the host dtype (one kernel: transpose and narrow), then to pinned memory
            pending.ids = ids_st[:n]
            pending.ids.copy_(major_ids[:n].copy_(src_ids.transpose(0, 1)), non_blocking=True)
            if host_slots is None:  # else the slots were filled from the host above
                src_slots = out_cache_loc[:n] if rows is None else out_cache_loc.index_select(0, index)
                pending.slots.copy_(src_slots, non_blocking=True)
            if w_st is not None and src_w is not None and major_w is not None:
                pending.weights = w_st[:n]
                pending.weights.copy_(major_w[:n].copy_(src_w.transpose(0, 1)), non_blocking=True)
            pending.n_rows = n
            pending.event = self._events[which]  # its last use was drained: this set was not in flight
            pending.event.record(stream)
        if host_slots is None:
            out_cache_loc.record_stream(stream)  # allocated on the main stream, read here: keep it until done
        self._last_copy = pending.event
        self._account(n, src_w is not None)
        self.pending.append(pending)

    def _start_copy_host(
        self, rows: list[int] | None, own: RowRange, out_cache_loc: torch.Tensor, pending: PendingCopy
    ) -> None:
        index = np.arange(own.length) if rows is None else np.asarray(rows, dtype=np.int64)
        dev_index = index + own.start
        np_ids = self.host_ids.dtype
        pending.ids = torch.from_numpy(np.ascontiguousarray(self.dev_ids.numpy()[:, dev_index].transpose(1, 0, 2),
                                                            dtype=np_ids))
        pending.slots = torch.from_numpy(out_cache_loc.numpy()[index].astype(np.int64))
        if self.dev_weights is not None:
            w = self.dev_weights.numpy()[:, dev_index].transpose(1, 0, 2)
            pending.weights = torch.from_numpy(np.ascontiguousarray(w))
        pending.n_rows = len(index)
        self._account(len(index), self.dev_weights is not None)
        self.pending.append(pending)

    def _account(self, n: int, with_weights: bool) -> None:
        per_row = self.dev_ids.shape[0] * self.dev_ids.shape[2]  # M x K ids
        step_bytes = n * (per_row * self.host_ids.itemsize + 8)  # + the int64 KV slot
        if with_weights:
            step_bytes += n * per_row * 2
        self.bytes_last_step = step_bytes
        self.bytes_total += step_bytes

    @property
    def full(self) -> bool:
        return len(self.pending) == len(self._staging)

    def drain_one(self) -> PendingCopy:
        """Wait for the oldest copy (already complete when the engine read its sampled tokens) and
        scatter it into the host buffer by KV slot."""
        p = self.pending.popleft()
        if p.event is not None:
            p.event.synchronize()
        slots = p.slots.numpy()
        if p.claim_slots:
            self.kv_forward[slots] = p.forward_id
        # A slot rewritten by a later forward since this copy started keeps its newer state.
        current = self.kv_forward[slots] == p.forward_id
        self.host_ids[slots[current]] = p.ids.numpy()[current]
        self.rows_forward[slots[current]] = p.forward_id
        if self.host_weights is not None and p.weights is not None:
            self.host_weights[slots[current]] = p.weights.numpy()[current]
        return p

    def claim(self, slots: np.ndarray, forward_id: int) -> None:
        """A forward is writing the KV of these slots: their host rows are stale until its copy lands."""
        self.kv_forward[slots] = forward_id

    def release(self, slots: np.ndarray) -> None:
        """These slots' KV was rejected (a speculative verify): no forward owns it, so a copy in flight never writes
        their host rows and valid_prefix never counts them."""
        self.kv_forward[slots] = -1

    def reject(self, rid: str, start: int, kept: int, slots: np.ndarray) -> bool:
        """A verify of rid's positions start..: the pending copy's entry keeps its first `kept` rows (the sink reads
        no more), and the rejected positions' slots are released. True when a pending copy held the entry."""
        found = False
        for p in self.pending:
            for j, (r, row0, n, prefix, phase) in enumerate(p.entries):
                if r == rid and prefix == start:
                    p.entries[j] = (r, row0, min(n, kept), prefix, phase)
                    found = True
        self.release(slots)
        return found

    def valid_prefix(self, slots: np.ndarray) -> int:
        """How many leading slots hold host routes of the KV currently in them."""
        kv = self.kv_forward[slots]
        bad = np.flatnonzero((self.rows_forward[slots] != kv) | (kv < 0))
        return int(bad[0]) if len(bad) else len(slots)

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Host rows of the given slots: [n, M, K] int32."""
        return self.host_ids[np.asarray(slots, dtype=np.int64)].astype(np.int32)

    def read_weights(self, slots: np.ndarray) -> np.ndarray | None:
        if self.host_weights is None:
            return None
        return self.host_weights[np.asarray(slots, dtype=np.int64)]

    def forwards_of(self, slots: np.ndarray) -> np.ndarray:
        """The forward whose routes the host holds for each slot: [n] int64."""
        return self.rows_forward[np.asarray(slots, dtype=np.int64)]
