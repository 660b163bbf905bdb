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
# This kernel reads x as it is and splits D over _LOGITS_SPLIT programs too, so T=64, E=64 runs 4 x 4 x 8 = 128
# programs of one 256-wide slice each, all loads in flight at once (a 16-step loop over D instead, one program
# per [4, 8] outputs, took 14.2 us: each step waits for its loads). The top-k kernel adds the partial sums.
_LOGITS_T, _LOGITS_E, _LOGITS_K = 16, 16, 64
_LOGITS_SPLIT = 8
# Above this many tokens (prefill) programs re-reading W cost more than the cast saves: torch, one part.
_LOGITS_MAX_T = 256
# batch_invariant's launches above _LOGITS_MAX_T tokens (torch_above=None): [WIDE_T, WIDE_E] tiles, so W is read by
# T / WIDE_T programs instead of T / 16. fp32 FMAs sum each output over D in order whatever the tile, so a row's
# bits are the narrow tile's (checked bitwise on the H200: tests/kernels/test_batch_invariance.py).
_WIDE_T, _WIDE_E, _WIDE_WARPS = 64, 64, 4


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
    grouped_topk takes; sum_partials adds them). One launch for T <= torch_above (256), P = 8; torch above, P = 1.
    torch_above=None: this kernel at every T, so a row's logits never depend on T (EngineConfig.batch_invariant;
    each program's tile sums its 256-wide slice of D in 64-wide steps in order: [16, 16] tiles up to 256 tokens,
    [_WIDE_T, _WIDE_E] above)."""
    require_tensor("x", x, 2, FLOAT_DTYPES, x.device)
    require_tensor("weight", weight, 2, (torch.float32,), x.device)
    T, D = x.shape
    E = weight.shape[0]
    require(weight.shape[1] == D, f"weight has {weight.shape[1]} features, x has D={D}")
    if torch_above is not None and torch_above < T:
        return router_logits_ref(x, weight).unsqueeze(0)
    # slices of whole BLOCK_K steps; a narrow D gets fewer parts rather than empty ones
    d_slice = triton.cdiv(triton.cdiv(D, _LOGITS_SPLIT), _LOGITS_K) * _LOGITS_K
    n_part = triton.cdiv(D, d_slice)
    parts = torch.empty((n_part, T, E), dtype=torch.float32, device=x.device)
    if T == 0:
        return parts
    wide = T > _LOGITS_MAX_T
    block_t, block_e, warps = (_WIDE_T, _WIDE_E, _WIDE_WARPS) if wide else (_LOGITS_T, _LOGITS_E, 4)
    grid = (triton.cdiv(T, block_t), triton.cdiv(E, block_e), n_part)
    _router_logits_kernel[grid](
        x, weight, parts, T, E, D, d_slice, x.stride(0), weight.stride(0), parts.stride(0), parts.stride(1),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=_LOGITS_K, UPCAST=not x.is_cuda, num_warps=warps,
    )
    return parts


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gate's fp32 linear of x cast to fp32: [T, E] (router_logits' parts summed, up to fp32 order)."""
    return F.linear(x.float(), weight)
