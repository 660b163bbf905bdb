"""The paged latent KV pool and the req_to_token table.

S KV slots in pages of `page_size` consecutive slots; L layers; C = kv_lora_rank + qk_rope_head_dim.
A request owns a list of pages; position p of the request lives in slot pages[p // P] * P + p % P.
Both structures are allocated once at construction: no device allocation while serving.
Bookkeeping (free lists, page lists) is on the host, so allocating never syncs with the device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class KVPool:
    """kv_buffer: [L, S, C] latent rows; a LIFO free list of page ids."""

    def __init__(
        self, num_layers: int, kv_dim: int, num_tokens: int, page_size: int, dtype: torch.dtype, device: str
    ) -> None:
        if num_tokens % page_size:
            raise ValueError(f"num_tokens={num_tokens} is not a multiple of page_size={page_size}")
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        # [L, S + 1, C]: slot S is never handed out; CUDA-graph decode writes its padding rows there.
        self.kv_buffer = torch.zeros(num_layers, num_tokens + 1, kv_dim, dtype=dtype, device=device)
        self.pad_slot = num_tokens
        # Reversed so pop() hands out the lowest page first: allocation order is reproducible.
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * self.num_pages  # catches double frees (a scheduler bug)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._is_free[p] = 0
        return out

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"KV page {p} freed twice")
            self._is_free[p] = 1
            self._free.append(p)

    def slots(self, pages: list[int], start: int, end: int) -> np.ndarray:
        """[end - start] int64 on the host: the KV slot of each position start..end-1.

        numpy, not torch: a decode step asks this once per running request, and each tiny torch CPU op
        costs 5-10 us (64 requests x 5 ops was ~2 ms of a 12 ms step on the H200 host); numpy costs ~1 us.
        """
        p = self.page_size
        if end - start == 1:  # the decode case
            return np.array([pages[start // p] * p + start % p], dtype=np.int64)
        first = start // p
        pos = np.arange(start, end, dtype=np.int64)
        page_ids = np.asarray(pages[first : -(-end // p)], dtype=np.int64)  # only the pages touched
        return page_ids[pos // p - first] * p + pos % p


class ReqToTokenPool:
    """req_to_token: [R, max_context_len] int32, row r maps a running request's positions to KV slots.

    R = max_running_requests: a row is held from admission to finish or retraction, and the scheduler
    never runs more requests than that, so no slack row is needed.
    """

    def __init__(self, num_rows: int, max_context_len: int, device: str) -> None:
        self.req_to_token = torch.zeros(num_rows, max_context_len, dtype=torch.int32, device=device)
        self._free: list[int] = list(range(num_rows - 1, -1, -1))
        self._pending: list[tuple[int, int, np.ndarray]] = []  # (row, start, slots) not yet on the device
        self._pending_ones: list[tuple[np.ndarray, np.ndarray]] = []  # (flat index [n], slot [n]): one slot a row

    @property
    def num_free_rows(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        """The row's writes not yet flushed are dropped: nobody reads a freed row, and a row handed to another
        request within one schedule (retraction, then admission) must not get the old writes on top of the
        new ones (index_copy_ with repeated indices keeps any of them on CUDA)."""
        if any(w[0] == row for w in self._pending):
            self._pending = [w for w in self._pending if w[0] != row]
        if self._pending_ones:
            width = self.req_to_token.shape[1]
            keep = [(f, v, f // width != row) for f, v in self._pending_ones]
            self._pending_ones = [(f[m], v[m]) for f, v, m in keep if m.any()]
        self._free.append(row)

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        """Positions start.. of `row` will point at `slots` once flush() runs (before the next forward)."""
        if len(slots):
            self._pending.append((row, start, np.asarray(slots, dtype=np.int64)))

    def write_ones(self, rows: list[int], starts: list[int], slots: np.ndarray) -> None:
        """Position starts[i] of rows[i] will point at slots[i]: a decode step's writes as one block."""
        if len(rows):
            width = self.req_to_token.shape[1]
            flat = np.asarray(rows, dtype=np.int64) * width + np.asarray(starts, dtype=np.int64)
            self._pending_ones.append((flat, np.asarray(slots, dtype=np.int64)))

    def flush(self, stage: Callable[[np.ndarray], torch.Tensor] | None = None) -> None:
        """Apply every pending write with one host->device copy and one scatter (no sync). Per-write
        copies cost one cudaMemcpy each: 64 decoding requests made 64 of them a step (~1 ms). Positions are
        distinct (free() drops a freed row's writes), so no deduplication; a decode step's 64 one-slot
        writes build their indices without a per-write arange (210 -> ~50 us a step on a 2-core host). stage: as in
        ForwardBatch.build."""
        if not self._pending and not self._pending_ones:
            return
        width = self.req_to_token.shape[1]
        pending, self._pending = self._pending, []
        ones, self._pending_ones = self._pending_ones, []
        flats, vals = [f for f, _ in ones], [v for _, v in ones]
        if pending:
            vals.append(np.concatenate([s for _, _, s in pending]))
            if len(vals[-1]) == len(pending):  # one slot each: the decode step
                flats.append(np.fromiter((row * width + start for row, start, _ in pending), np.int64, len(pending)))
            else:
                flats.append(np.concatenate([row * width + start + np.arange(len(s)) for row, start, s in pending]))
        both = np.concatenate(flats + vals)
        dev = self.req_to_token.device
        packed = (stage(both) if stage is not None else torch.from_numpy(both).to(dev, non_blocking=True)).view(2, -1)
        self.req_to_token.view(-1).index_copy_(0, packed[0], packed[1].to(torch.int32))
