"""MoE align: token-expert pairs sorted by expert, each expert's run padded to the GEMM's BLOCK_M.

Shape legend: T tokens, K top-k, M = T*K pairs, E local experts, P = padded capacity (a host-side bound).

    topk_ids [T, K] (-1: expert not on this rank, skipped)
    sorted_ids [P] int32    pair index t*K+k, grouped by expert in increasing pair order; padding = M
    block_expert [P/BM]     expert of each BLOCK_M block; -1 from the first unused block on
    num_padded [1] int32    rows actually used, sum_e ceil(count_e / BM) * BM (on the device: no host sync)

Entries of sorted_ids past num_padded are left unwritten (the GEMMs exit before reading them).

Two twins, same outputs bit for bit (the order within an expert is the pair order in both, so the MoE
built on either is bitwise the same):
  moe_align_ref: ~25 torch ops including a radix sort (argsort); under a CUDA graph at T = 1 they cost
    ~0.1 ms of launch gaps against ~21 us of expert weights (BENCHMARKS.md#fused-moe).
  moe_align: Triton, one launch when M fits one chunk (decode sizes), else two: per-chunk counts, then
    every chunk program derives totals, padded prefix sums and its chunk's offsets from the counts and
    scatters its pairs. Ranks within an expert come from a one-hot [SUB, E] cumulative sum, so no
    atomics: deterministic, which the engine's exact-routes guarantee needs (a route can flip on an ulp).
    The launch shape is an AlignTile (config.py): pairs per chunk program, one-hot rows, warps, or one [M, E]
    tile that gives both the counts and the ranks (one pass, one launch). At decode sizes the default is 32-pair
    chunks (6.3 vs 8.5 us for 64-pair chunks at T = 64 of the end-to-end model, 512 pairs over 66 experts;
    BENCHMARKS.md#fused-moe).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from r3trace.kernels.contract import INDEX_DTYPES, require, require_tensor
from r3trace.kernels.moe.config import LARGE_ALIGN, AlignTile

ONE_HOT_ELEMS = 8192  # [SUB, BLOCK_E] one-hot tile: 32 int32 per thread at 8 warps, no spills
SUBS_PER_CHUNK = 8  # a chunk is 8 one-hot tiles: 256 pairs at E = 256, 8192 at E = 8
# each chunk program re-reads all [C, E] counts: C^2 * E * 4 B = 64 MB of L2 at E = 256; with 128 chunks
# the H200 took 0.20 ms at T = 16k, E = 256 (64 serial 16-pair tiles a pass), as long as the torch twin
MAX_CHUNKS = 256


class MoeAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # [P] int32
    block_expert: torch.Tensor  # [P / block_m] int32
    num_padded: torch.Tensor  # [1] int32


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """P = M + min(E, M) * (BM - 1) rounded up to BM: at most min(E, M) experts are non-empty and each
    wastes at most BM - 1 rows of padding."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


@functools.lru_cache(maxsize=8)
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def has_pdl(t: torch.Tensor) -> bool:
    """Programmatic dependent launch (griddepcontrol) runs compiled on sm_90+ only; the interpreter has none."""
    return t.is_cuda and _sm90(t.device.index or 0)


def _check(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    require_tensor("topk_ids", topk_ids, 2, INDEX_DTYPES, topk_ids.device)
    require(topk_ids.is_contiguous(), "topk_ids must be contiguous")
    require(block_m >= 1, f"block_m {block_m} must be >= 1")
    require(1 <= num_experts <= 1024, f"num_experts {num_experts} must be in [1, 1024]")


@triton.jit
def _chunk_counts(ids_ptr, start, end, offs_e, e_mask, SUB: tl.constexpr, BLOCK_E: tl.constexpr):
    counts = tl.zeros((BLOCK_E,), tl.int32)  # [BLOCK_E]
    for s in range(start, end, SUB):
        offs = s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < end, other=-1).to(tl.int32)
        counts += tl.sum(((ids[:, None] == offs_e[None, :]) & e_mask[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _align_count_kernel(
    ids_ptr, counts_ptr, M, E, chunk, SUB: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    if PDL:  # a programmatic dependent: the kernel ahead (top-k, the last call's sum) may still run
        gdc_wait()
        gdc_launch_dependents()
    c = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    start = c * chunk
    counts = _chunk_counts(ids_ptr, start, tl.minimum(start + chunk, M), offs_e, e_mask, SUB, BLOCK_E)
    tl.store(counts_ptr + c * E + offs_e, counts, mask=e_mask)


@triton.jit
def _align_scatter_kernel(
    # pointers
    ids_ptr, counts_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    # sizes
    M, E, num_chunks, chunk, num_blocks,
    # constexpr
    SINGLE: tl.constexpr, ONE_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr, SUB: tl.constexpr, PAD_ROWS: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # nothing global is read or written before the kernel ahead is complete
        gdc_wait()
        gdc_launch_dependents()
    c = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    start = c * chunk
    end = tl.minimum(start + chunk, M)
    if ONE_TILE:  # all M <= SUB pairs in one one-hot tile: the counts and the ranks come from the same tile
        offs_all = tl.arange(0, SUB)
        ids_all = tl.load(ids_ptr + offs_all, mask=offs_all < M, other=-1).to(tl.int32)
        hit_all = ((ids_all[:, None] == offs_e[None, :]) & e_mask[None, :]).to(tl.int32)  # [SUB, BLOCK_E]
        totals = tl.sum(hit_all, axis=0)
        before = tl.zeros((BLOCK_E,), tl.int32)
    elif SINGLE:  # one program owns all M pairs: count them here, nothing before it
        totals = _chunk_counts(ids_ptr, 0, M, offs_e, e_mask, SUB, BLOCK_E)
        before = tl.zeros((BLOCK_E,), tl.int32)
    else:
        totals = tl.zeros((BLOCK_E,), tl.int32)  # [BLOCK_E] pairs per expert
        before = tl.zeros((BLOCK_E,), tl.int32)  # [BLOCK_E] pairs per expert in chunks before c
        for c0 in range(0, num_chunks, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            cc = tl.load(counts_ptr + offs_c[:, None] * E + offs_e[None, :],
                         mask=(offs_c[:, None] < num_chunks) & e_mask[None, :], other=0)  # fmt: skip
            totals += tl.sum(cc, axis=0)
            before += tl.sum(tl.where(offs_c[:, None] < c, cc, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BLOCK_E]
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    num_padded = tl.sum(padded, axis=0)

    # scatter: dest = pad_start[e] + pairs of e in earlier chunks + rank of the pair within its tile
    running = pad_start + before  # [BLOCK_E]
    if ONE_TILE:
        rank_all = tl.cumsum(hit_all, axis=0) - hit_all  # exclusive: earlier pairs of the same expert
        dest_all = tl.sum(hit_all * (rank_all + running[None, :]), axis=1)  # [SUB]
        tl.store(sorted_ids_ptr + dest_all, offs_all, mask=tl.sum(hit_all, axis=1) > 0)
        end = start  # the tile loop below has nothing left to scatter
    for s in range(start, end, SUB):
        offs = s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + offs, mask=offs < end, other=-1).to(tl.int32)
        hit = ((ids[:, None] == offs_e[None, :]) & e_mask[None, :]).to(tl.int32)  # [SUB, BLOCK_E]
        rank = tl.cumsum(hit, axis=0) - hit  # exclusive: earlier pairs of the same expert in this tile
        dest = tl.sum(hit * (rank + running[None, :]), axis=1)  # [SUB]
        tl.store(sorted_ids_ptr + dest, offs, mask=tl.sum(hit, axis=1) > 0)
        running += tl.sum(hit, axis=0)

    # padding rows [pad_start + totals, pad_end) of every expert get the sentinel M; rows split by program
    gap = padded - totals
    fill = pad_start + totals
    for j0 in range(c * PAD_ROWS, BLOCK_M, num_chunks * PAD_ROWS):
        offs_j = j0 + tl.arange(0, PAD_ROWS)
        sentinel = tl.full((BLOCK_E, PAD_ROWS), 0, tl.int32) + M
        tl.store(sorted_ids_ptr + fill[:, None] + offs_j[None, :], sentinel,
                 mask=e_mask[:, None] & (offs_j[None, :] < gap[:, None]))  # fmt: skip

    # block b's expert: the first e with pad_end[e] > b * BLOCK_M (empty experts have none), -1 past the end
    for b0 in range(c * BLOCK_B, num_blocks, num_chunks * BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        row0 = offs_b * BLOCK_M
        owner = tl.sum(((pad_end[None, :] <= row0[:, None]) & e_mask[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + offs_b, tl.where(row0 < num_padded, owner, -1), mask=offs_b < num_blocks)
    if c == 0:
        tl.store(num_padded_ptr, num_padded)


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    chunk: int | None = None,
    tile: AlignTile = LARGE_ALIGN,
    pdl: bool = False,
) -> MoeAlignment:
    """topk_ids [T, K] -> MoeAlignment (module docstring); Triton, 1-2 launches, no host sync.
    tile: the launch shape (config.py's AlignTile; the default is the large-M launch, align_tile picks per size).
    chunk: pairs per program, over tile.chunk (None: 8 one-hot tiles, at most MAX_CHUNKS programs); tests
    pass odd ones. pdl: launched as programmatic dependents (sm_90+ compiled; ignored elsewhere)."""
    _check(topk_ids, num_experts, block_m)
    require(tile.num_warps in (1, 2, 4, 8, 16), f"align num_warps {tile.num_warps} not a power of 2 <= 16")
    dev, E = topk_ids.device, num_experts
    M = topk_ids.numel()
    cap = align_capacity(M, E, block_m)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    block_expert = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    if M == 0:
        return MoeAlignment(sorted_ids, block_expert, torch.zeros(1, dtype=torch.int32, device=dev))
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(E)
    one_tile = chunk is None and tile.one_tile_pairs >= M
    if one_tile:  # at least 16 rows: Triton's layouts want a tile of a warp's width or more
        sub, chunk = max(16, triton.next_power_of_2(M)), M
    else:
        sub = tile.sub or max(1, ONE_HOT_ELEMS // block_e)
        require(sub & (sub - 1) == 0, f"align sub {sub} must be a power of 2")
    if chunk is None:
        chunk = tile.chunk or max(SUBS_PER_CHUNK * sub, triton.cdiv(M, MAX_CHUNKS))
    require(chunk >= 1, f"chunk {chunk} must be >= 1")
    num_chunks = triton.cdiv(M, chunk)
    counts = torch.empty((num_chunks, E), dtype=torch.int32, device=dev) if num_chunks > 1 else num_padded
    warps = tile.num_warps
    pdl = pdl and has_pdl(topk_ids)
    if num_chunks > 1:
        _align_count_kernel[(num_chunks,)](topk_ids, counts, M, E, chunk, SUB=sub, BLOCK_E=block_e, PDL=pdl,
                                           num_warps=warps, launch_pdl=pdl)  # fmt: skip
    _align_scatter_kernel[(num_chunks,)](
        topk_ids, counts, sorted_ids, block_expert, num_padded,
        M, E, num_chunks, chunk, cap // block_m,
        SINGLE=num_chunks == 1, ONE_TILE=one_tile, BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_C=min(MAX_CHUNKS, ONE_HOT_ELEMS // block_e), SUB=sub,  # fixed per tile (one tile: per pow2 of M)
        PAD_ROWS=min(triton.next_power_of_2(block_m), sub), BLOCK_B=sub, PDL=pdl, num_warps=warps, launch_pdl=pdl,
    )  # fmt: skip
    return MoeAlignment(sorted_ids, block_expert, num_padded)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """The torch twin of moe_align: same outputs, ~25 launches and a radix sort; static sizes, no host sync."""
    _check(topk_ids, num_experts, block_m)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [M]
    M = flat.numel()
    cap = align_capacity(M, num_experts, block_m)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # [M], skipped -> last bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(
        0, key, torch.ones_like(key)
    )  # [E+1]
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    pad_end = padded.cumsum(0)  # [E]
    pad_start = pad_end - padded  # [E]
    order = torch.argsort(key, stable=True)  # [M] pair indices grouped by expert
    sorted_key = key[order]  # [M]
    count_start = counts.cumsum(0) - counts  # [E+1]
    rank = torch.arange(M, device=dev) - count_start[sorted_key]  # [M] rank within its expert
    dest = torch.where(
        sorted_key < num_experts, pad_start[sorted_key.clamp(max=num_experts - 1)] + rank, cap
    )  # [M], skipped pairs land in a dump slot past the end
    sorted_ids = torch.full((cap + 1,), M, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, cap, block_m, device=dev)  # [P / block_m]
    block_expert = torch.searchsorted(pad_end, block_starts, right=True)  # [P / block_m]
    block_expert = torch.where(block_starts < pad_end[-1:], block_expert, -1).to(torch.int32)
    num_padded = pad_end[-1:].to(torch.int32)  # [1]
    return MoeAlignment(sorted_ids[:cap], block_expert, num_padded)
