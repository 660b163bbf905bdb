"""Router logits in fp32 from bf16 (or any float) rows, split over D: the gate's GEMM without a cast kernel.

Shape legend: T tokens, D hidden, E routed experts, P slices of D. The partial sums [P, T, E] go to
r3trace.kernels.topk.grouped_topk, which adds them in order p = 0..P-1 (topk.sum_partials is that order in torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from r3trace.kernels.contract import FLOAT_DTYPES, require, require_tensor
from r3trace.kernels.dot import row_mma_acc

# Router logits [T, E] = x [T, D] (bf16/fp16/fp32) . weight [E, D] fp32, in fp32 (DeepSeek and transformers keep
# the gate in fp32). torch casts x first: a cast kernel, then cuBLAS's SIMT sgemm + split-K reduce at decode
# sizes (2.8 + 6.0 + 2.4 us a layer at T=64, D=2048, E=64 on an H200: BENCHMARKS.md#end-to-end).
# This kernel reads x as it is and splits D into parts too (all loads in flight at once; a loop over D in one
# program per tile waits for each step's loads); the top-k kernel adds the partial sums in order.
# Parts: slices of at least _SLICE_MIN columns, at most _MAX_PARTS of them (D = 2048: 16 x 128, D = 7168: 28 x 256).
# Tiles [BLOCK_T, BLOCK_E, BLOCK_K, warps]: the widest rung of _TILES whose programs (tiles x parts) still reach
# _MIN_PROGRAMS (~3/4 of an H200's 132 SMs), BLOCK_T at most max(16, T). fp32 FMAs sum each output over its slice in
# order whatever the tile, so a row's bits depend on D's parts alone, never on T or the tile (bitwise on the H200 at
# T = 1 .. 1024 for bench/route_kernels.py's four shapes; tests/kernels/test_batch_invariance.py crosses the rungs).
# On the H200 (us a call, bench/results/route_kernels-h200.json) the fixed [16, 16] tiles and 8 parts took 85 us
# at T = 256, E = 256, D = 2048 (the V3 routing shape's decode at batch 256), the ladder's rung 24; at T = 1, D = 7168
# 21 us against 8-13 with 28 parts.
_SLICE_MIN, _MAX_PARTS = 128, 32
_TILES = ((16, 16, 64, 4), (16, 32, 64, 4), (16, 64, 64, 4), (32, 64, 64, 4), (64, 64, 32, 4), (128, 64, 32, 8))
_MIN_PROGRAMS = 96
# Above this many tokens (prefill) programs re-reading W cost more than the cast saves: torch, one part.
_LOGITS_MAX_T = 256


@triton.jit
def _router_logits_kernel(
    x_ptr, w_ptr, part_ptr,
    T, E, D, D_SLICE,
    stride_xt, stride_we, stride_pp, stride_pt,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    part = tl.program_id(2)
    t_mask, e_mask = offs_t < T, offs_e < E
    d_lo = part * D_SLICE
    d_hi = tl.minimum(d_lo + D_SLICE, D)
    acc = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for d0 in range(d_lo, d_hi, BLOCK_K):
        offs_d = d0 + tl.arange(0, BLOCK_K)
        d_mask = offs_d < d_hi
        x = tl.load(x_ptr + offs_t[:, None] * stride_xt + offs_d[None, :], mask=t_mask[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(w_ptr + offs_e[:, None] * stride_we + offs_d[None, :], mask=e_mask[:, None] & d_mask[None, :],
                    other=0.0)  # fmt: skip
        acc = row_mma_acc(x, tl.trans(w), acc, UPCAST, "ieee")  # fp32 FMAs, no tf32
    dst = part_ptr + part * stride_pp + offs_t[:, None] * stride_pt + offs_e[None, :]
    tl.store(dst, acc, mask=t_mask[:, None] & e_mask[None, :])


def router_logits(x: torch.Tensor, weight: torch.Tensor, torch_above: int | None = _LOGITS_MAX_T) -> torch.Tensor:
    """x: [T, D] float; weight: [E, D] fp32 -> logits as partial sums [P, T, E] fp32 over P slices of D (what
    grouped_topk takes; sum_partials adds them). One launch for T <= torch_above (256), P = logits_parts(D); torch
    above, P = 1.
    torch_above=None: this kernel at every T, so a row's logits never depend on T (EngineConfig.batch_invariant;
    each program's tile sums its slice of D in BLOCK_K-wide steps in order, whatever its tile: logits_tile)."""
    require_tensor("x", x, 2, FLOAT_DTYPES, x.device)
    require_tensor("weight", weight, 2, (torch.float32,), x.device)
    T, D = x.shape
    E = weight.shape[0]
    require(weight.shape[1] == D, f"weight has {weight.shape[1]} features, x has D={D}")
    if torch_above is not None and torch_above < T:
        return router_logits_ref(x, weight).unsqueeze(0)
    d_slice, n_part = logits_parts(D)
    parts = torch.empty((n_part, T, E), dtype=torch.float32, device=x.device)
    if T == 0:
        return parts
    block_t, block_e, block_k, warps = logits_tile(T, E, n_part, compiled=x.is_cuda)
    grid = (triton.cdiv(T, block_t), triton.cdiv(E, block_e), n_part)
    _router_logits_kernel[grid](
        x, weight, parts, T, E, D, d_slice, x.stride(0), weight.stride(0), parts.stride(0), parts.stride(1),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, UPCAST=not x.is_cuda, num_warps=warps,
    )
    return parts


def logits_parts(d: int) -> tuple[int, int]:
    """D -> (slice width, parts P): slices of whole 64-column steps (every rung's BLOCK_K divides them), at least
    _SLICE_MIN wide, at most _MAX_PARTS of them; a narrow D gets fewer parts rather than empty ones."""
    d_slice = max(_SLICE_MIN, triton.cdiv(triton.cdiv(d, _MAX_PARTS), 64) * 64)
    return d_slice, triton.cdiv(d, d_slice)


def logits_tile(t: int, e: int, n_part: int, compiled: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K, warps): the widest rung of _TILES with BLOCK_T <= max(16, t) whose programs
    reach _MIN_PROGRAMS, else the narrowest. compiled=False (Triton's interpreter): the narrowest at every T, since
    there kernels/dot.py's row_mma sums each BLOCK_K step with numpy, whose pairwise order follows BLOCK_K."""
    pick = _TILES[0]
    for bt, be, bk, warps in _TILES[1:] if compiled else ():
        if bt <= max(16, t) and triton.cdiv(t, bt) * triton.cdiv(e, be) * n_part >= _MIN_PROGRAMS:
            pick = (bt, be, bk, warps)
    return pick


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gate's fp32 linear of x cast to fp32: [T, E] (router_logits' parts summed, up to fp32 order)."""
    return F.linear(x.float(), weight)
