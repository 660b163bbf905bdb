"""Fused MoE: align token-expert pairs by expert, grouped GEMMs for gate_up (+SiLU-and-mul) and down, sum over K.

Shape legend: T tokens, D hidden, E local experts, I moe_intermediate_size, K top-k, M = T*K pairs.

    hidden [T, D]; w13 [E, 2I, D] (rows 0..I-1 gate_proj, I..2I-1 up_proj); w2 [E, D, I]
    topk_ids [T, K] int32 (-1: expert not on this rank, skipped); topk_weights [T, K] fp32
    out [T, D] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)),
                 e = topk_ids[t, k]

Grouped path (SGLang's fused_moe layout, 4-5 launches, no host sync, so it can sit inside a CUDA graph):
  1. moe_align (align.py, 1-2 launches): pair indices sorted by expert, each expert's run padded to BLOCK_M with the
     sentinel M, the expert of every BLOCK_M block, and the rows used.
  2. moe_gate_up (gemm.py, as 3): act [M, I] = silu(x W_gate^T) * (x W_up^T), both products in one program (the A
     tile is loaded once for both), written in the activation dtype.
  3. moe_down: y [M, D] = topk_weight * (act W2^T). Its own tiles: N = D is long and K = I short.
  4. moe_sum: out [T, D] = sum over k of y, fp32 accumulation, skipping ids of -1.
Options (config.py): weight tiles through TMA descriptors (GemmTile.tma, the default from 128 rows per expert on: no
per-thread address math for 2/3 of each stage's bytes; the gate_up's A is a row gather, which Hopper's TMA cannot do);
every kernel launched as a programmatic dependent (MoeConfig.pdl: it may start while the kernel ahead finishes and
waits for it before any global access; on at decode sizes: 109.2 vs 112.1 us at D = 2048, T = 64). moe_config may
instead pick the gemv path (gemv.py): no align, two launches (T = 1, and T <= 4 at I <= 256).

The y [M, D] round trip stays: the down adding its weighted rows into a zeroed fp32 [T, D] with tl.atomic_add was
slower on the H200 (E = 256, T = 4k: 1.52 vs 1.27 ms a pipeline; a token's K pairs sit in blocks far apart in launch
order, so the adds are not hidden under the product) and its bits varied between calls. BENCHMARKS.md#fused-moe.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from r3trace.kernels.contract import FLOAT_DTYPES, require, require_tensor
from r3trace.kernels.moe.align import has_pdl, moe_align, moe_align_ref
from r3trace.kernels.moe.config import AlignTile, GemmTile, GemvTile, MoeConfig, grouped_config, moe_config
from r3trace.kernels.moe.gemm import moe_down, moe_gate_up
from r3trace.kernels.moe.gemv import gemv_moe
from r3trace.kernels.moe.reference import fused_moe_ref  # re-exported: the one reference

__all__ = [
    "AlignTile", "GemmTile", "GemvTile", "MoeConfig", "fused_moe", "fused_moe_ref", "grouped_config", "moe_config",
    "moe_down", "moe_gate_up", "moe_sum",
]  # fmt: skip


@triton.jit
def _moe_sum_kernel(
    # pointers
    y_ptr, ids_ptr, out_ptr,
    # sizes
    D,
    # strides
    stride_ym, stride_it, stride_ot,
    # constexpr
    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # a programmatic dependent of the down: y is complete after the wait
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + t * stride_it + k)
        on_rank = d_mask & ((offs_d * 0 + expert) >= 0)  # rows of skipped pairs (-1) were never written
        row = (t * TOP_K + k).to(tl.int64)
        acc += tl.load(y_ptr + row * stride_ym + offs_d, mask=on_rank, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


def _check_moe_args(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> None:
    dev = hidden.device
    require_tensor("hidden", hidden, 2, FLOAT_DTYPES, dev)
    require_tensor("w13", w13, 3, (hidden.dtype,), dev)
    require_tensor("w2", w2, 3, (hidden.dtype,), dev)
    require_tensor("topk_ids", topk_ids, 2, (torch.int32,), dev)
    require_tensor("topk_weights", topk_weights, 2, (torch.float32,), dev)
    T, D = hidden.shape
    E, two_i, d13 = w13.shape
    require(d13 == D and two_i % 2 == 0, f"w13 shape {tuple(w13.shape)} is not [E, 2I, D={D}]")
    I = two_i // 2
    require(tuple(w2.shape) == (E, D, I), f"w2 shape {tuple(w2.shape)} is not [E={E}, D={D}, I={I}]")
    require(w13.is_contiguous() and w2.is_contiguous(), "w13 and w2 must be contiguous")
    require(topk_ids.shape[0] == T, f"topk_ids has {topk_ids.shape[0]} rows, hidden has T={T}")
    require(
        topk_weights.shape == topk_ids.shape,
        f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}",
    )
    require(topk_ids.is_contiguous() and topk_weights.is_contiguous(), "topk_ids/weights: not contiguous")


AlignBackend = Literal["triton", "ref"]


def moe_sum(y: torch.Tensor, topk_ids: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """y [T*K, D] -> out [T, D] = sum over k, fp32 accumulation, ids of -1 contribute nothing; pdl: launched as a
    programmatic dependent (sm_90+ compiled)."""
    T, K = topk_ids.shape
    D = y.shape[1]
    out = torch.empty((T, D), dtype=y.dtype, device=y.device)
    block_d = 1024
    pdl = pdl and has_pdl(y)
    _moe_sum_kernel[(T, triton.cdiv(D, block_d))](
        y, topk_ids, out, D, y.stride(0), topk_ids.stride(0), out.stride(0),
        TOP_K=K, BLOCK_D=block_d, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: MoeConfig | None = None,
    align: AlignBackend = "triton",
) -> torch.Tensor:
    """hidden [T, D] -> [T, D]; see the module docstring. config=None: moe_config's choice (the gemv path
    at T = 1, else grouped tiles by rows per expert); align picks the alignment twin of the grouped path
    (same result bit for bit; "ref" is the torch one)."""
    _check_moe_args(hidden, w13, w2, topk_ids, topk_weights)
    require(align in ("triton", "ref"), f"align {align!r} not in ('triton', 'ref')")
    T, D = hidden.shape
    E = w13.shape[0]
    K = topk_ids.shape[1]
    if T * K == 0:
        return torch.empty((T, D), dtype=hidden.dtype, device=hidden.device)
    cfg = config or moe_config(T * K, E, hidden.element_size(), w2.shape[2], tokens=T, hidden=D)
    if cfg.gemv is not None:  # gemv.py: no alignment (the align argument has nothing to pick)
        return gemv_moe(hidden, w13, w2, topk_ids, topk_weights, cfg.gemv)
    if align == "triton":
        alignment = moe_align(topk_ids, E, cfg.block_m, tile=cfg.align, pdl=cfg.pdl)
    else:
        alignment = moe_align_ref(topk_ids, E, cfg.block_m)
    act = moe_gate_up(hidden, w13, alignment, K, cfg.block_m, cfg.gate_up, cfg.pdl)
    y = moe_down(act, w2, alignment, topk_weights, cfg.block_m, cfg.down, cfg.pdl)
    return moe_sum(y, topk_ids, cfg.pdl)
