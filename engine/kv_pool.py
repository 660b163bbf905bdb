"""The paged latent KV pool and the req_to_token table.

S KV slots in pages of `page_size` consecutive slots; L layers; C = kv_lora_rank + qk_rope_head_dim.
A request owns a list of pages; position p of the request lives in slot pages[p // P] * P + p % P.
Both structures are allocated once at construction: no device allocation while serving.
Bookkeeping (free lists, page lists) is on the host, so allocating never syncs with the device.
"""

from __future__ import annotations

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

    def slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """[end - start] int64 on the host: the KV slot of each position start..end-1."""
        pos = torch.arange(start, end, dtype=torch.int64)
        page_ids = torch.tensor(pages, dtype=torch.int64)
        return page_ids[pos // self.page_size] * self.page_size + pos % self.page_size


class ReqToTokenPool:
    """req_to_token: [R, max_context_len] int32, row r maps a running request's positions to KV slots.

    R = max_running_requests: a row is held from admission to finish or retraction, and the scheduler
    never runs more requests than that, so no slack row is needed.
    """

    def __init__(self, num_rows: int, max_context_len: int, device: str) -> None:
        self.req_to_token = torch.zeros(num_rows, max_context_len, dtype=torch.int32, device=device)
        self._free: list[int] = list(range(num_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Positions start.. of `row` point at `slots` (one host->device copy, no sync)."""
        dst = self.req_to_token[row, start : start + slots.numel()]
        dst.copy_(slots.to(dtype=torch.int32), non_blocking=True)
