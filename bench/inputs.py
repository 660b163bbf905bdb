"""Random inputs the bench scripts and the kernel tests share: paged MLA decode inputs and MoE routes.

Shape legend: B requests, H heads, C = kv_lora + rope latent columns, S cache slots, T tokens, E experts, K top-k.

One builder of paged decode inputs serves both: tests/kernels/conftest.py takes its req_to_token tables from here
(mixed lengths, tiny heads, random data drawn on the host from one generator), the bench scripts their H200 cells
(every request kv_len long, gigabytes of cache drawn on the device). MoE routes likewise: `routes` (distinct experts
a token, some ids -1, drawn from the caller's generator) serves tests/kernels/moe_cases.py and
bench/moe_verify_tiles.py.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from bench.timing import copies_for
from r3trace.kernels.mla_decode import DecodeTile, mla_decode


def paged_req_to_token(
    lens: list[int], page_size: int, gen: torch.Generator, extra_rows: int = 2, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A req_to_token table for requests of the given lengths, pages shuffled so no request's pages are
    contiguous, request rows shuffled too (extra_rows rows no request uses), 3 spare pages no request owns.
    width: the table's columns (default max(lens) + 5; the bench rounds it up to a multiple of 16, as the
    engine's tables are). Returns (req_to_token [R, width] int32 on the host, req_pool_indices [B] int64,
    number of slots S)."""
    B = len(lens)
    pages_per_req = [(n + page_size - 1) // page_size for n in lens]
    num_pages = sum(pages_per_req) + 3  # spare pages: slots no request owns hold random data too
    page_order = torch.randperm(num_pages, generator=gen)
    rows = torch.randperm(B + extra_rows, generator=gen)[:B]
    max_ctx = width if width is not None else max(lens) + 5
    if max_ctx < max(lens):
        raise ValueError(f"width {max_ctx} is below the longest request ({max(lens)} tokens)")
    req_to_token = torch.full((B + extra_rows, max_ctx), -1, dtype=torch.int32)
    next_page = 0
    for b, n in enumerate(lens):
        pages = page_order[next_page : next_page + pages_per_req[b]]
        next_page += pages_per_req[b]
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:n]
        req_to_token[rows[b], :n] = slots.to(torch.int32)
    return req_to_token, rows.long(), num_pages * page_size


class DecodeInputs(NamedTuple):
    q: torch.Tensor  # [B, H, C]
    kv_cache: torch.Tensor  # [S, C]
    req_to_token: torch.Tensor  # [R, width] int32
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64


def paged_decode_inputs(
    lens: list[int],
    heads: int,
    kv_lora: int,
    rope: int,
    page_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    gen: torch.Generator,
    data_gen: torch.Generator | None = None,
    width: int | None = None,
) -> DecodeInputs:
    """mla_decode's inputs: the table from paged_req_to_token(lens, page_size, gen), then q and the cache drawn
    from data_gen (default gen, on the host) and moved to device as dtype. A generator on the device (data_gen)
    draws the H200 cells' gigabytes of cache where they live."""
    req_to_token, rows, slots = paged_req_to_token(lens, page_size, gen, width=width)
    C = kv_lora + rope
    src = data_gen if data_gen is not None else gen
    q = torch.randn(len(lens), heads, C, generator=src, device=src.device).to(device, dtype)
    kv_cache = torch.randn(slots, C, generator=src, device=src.device).to(device, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    return DecodeInputs(q, kv_cache, req_to_token.to(device), rows.to(device), seq_lens)


def decode_cell(
    B: int, L: int, heads: int, device: str, seed: int = 0, kv_lora: int = 512, rope: int = 64, page_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> DecodeInputs:  # fmt: skip
    """One bench cell: B requests all L long on shuffled page_size-slot pages, the table L rounded up to 16 wide,
    q and the cache drawn on the device."""
    gen = torch.Generator().manual_seed(seed)
    data_gen = torch.Generator(device=device).manual_seed(seed)
    width = -(-L // 16) * 16
    return paged_decode_inputs([L] * B, heads, kv_lora, rope, page_size, dtype, device, gen, data_gen, width)


class DecodeCell(NamedTuple):
    """One timed MLA decode cell of the bench scripts: its inputs, the caches a timing rotates over, and the work
    of one call (so each script reports % of copy and TFLOP/s the same way)."""

    inp: DecodeInputs
    caches: list[torch.Tensor]  # inp.kv_cache, then copies: together >= 4x the L2 on CUDA, one cache on CPU
    nbytes: int  # the latent cache read once: B L C x 2 bytes (bf16)
    flops: int  # 2 B H L (C + kv_lora): the scores over C columns, the output over kv_lora

    def calls(self, kv_lora: int, scale: float, splits: int, tile: DecodeTile) -> list[partial[torch.Tensor]]:
        """r3trace's mla_decode on each cache in turn (what Timer.graph_ms rotates over)."""
        inp = self.inp
        return [partial(mla_decode, inp.q, c, *inp[2:], kv_lora, scale, splits, tile) for c in self.caches]

    def rates(self, ms: float, copy_gbs: float) -> tuple[float, float]:
        """(% of the copy bandwidth, TFLOP/s) of a call taking ms."""
        return 100 * self.nbytes / ms / 1e6 / copy_gbs, self.flops / ms / 1e9


def rotated_decode_cell(
    B: int, L: int, heads: int, device: str, kv_lora: int = 512, rope: int = 64, page_size: int = 64
) -> DecodeCell:
    """decode_cell(B, L, heads) and the cache copies a timing rotates over so every call reads HBM."""
    C = kv_lora + rope
    nbytes, flops = B * L * C * 2, 2 * B * heads * L * (C + kv_lora)
    inp = decode_cell(B, L, heads, device, kv_lora=kv_lora, rope=rope, page_size=page_size)
    n_copies = copies_for(nbytes) if device == "cuda" else 1  # the CPU smoke times one cache
    caches = [inp.kv_cache] + [torch.randn_like(inp.kv_cache) for _ in range(n_copies - 1)]
    return DecodeCell(inp, caches, nbytes, flops)


def moe_routes(T: int, E: int, K: int, device: str, gen: torch.Generator | None = None) -> torch.Tensor:
    """topk_ids [T, K] int32: K distinct experts per token, uniform at random (the top-k of uniform scores)."""
    scores = torch.rand(T, E, generator=gen, device=gen.device if gen is not None else device)
    return scores.topk(K, dim=-1).indices.to(device=device, dtype=torch.int32)


def routes(T: int, E: int, K: int, gen: torch.Generator, empty: tuple[int, ...] = ()) -> torch.Tensor:
    """Distinct experts per token (as a top-k gives), never the experts in `empty`, some ids -1."""
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(T)])
    off_rank = torch.rand(T, K, generator=gen) < 0.15  # experts on another EP rank
    return torch.where(off_rank, -1, ids).to(torch.int32)
