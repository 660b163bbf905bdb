"""Fused MoE: align token-expert pairs by expert, grouped GEMMs for gate_up (+SiLU-and-mul) and down.

Shape legend: T tokens, D hidden, E local experts, I moe_intermediate_size, K top-k, M = T*K pairs.

    hidden [T, D]; w13 [E, 2I, D] (rows 0..I-1 gate_proj, I..2I-1 up_proj); w2 [E, D, I]
    topk_ids [T, K] int32 (-1: expert not on this rank, skipped); topk_weights [T, K] fp32
    out [T, D] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)),
                 e = topk_ids[t, k]

Pipeline (SGLang's fused_moe layout, 4-5 launches, no host sync, so it can sit inside a CUDA graph):
  1. moe_align (kernels/moe_align.py, 1-2 launches): pair indices sorted by expert, each expert's run
     padded to BLOCK_M with the sentinel M, the expert of every BLOCK_M block, and the rows used.
  2. moe_gate_up (kernels/moe_gemm.py, as 3): act [M, I] = silu(x W_gate^T) * (x W_up^T), both products in
     one program (the A tile is loaded once for both), written in the activation dtype.
  3. moe_down: y [M, D] = topk_weight * (act W2^T). Its own tiles: N = D is long and K = I short.
  4. moe_sum: out [T, D] = sum over k of y, fp32 accumulation, skipping ids of -1.
Options (kernels/moe_config.py): weight tiles through TMA descriptors (GemmTile.tma, the default from 128 rows
per expert on: no per-thread address math for 2/3 of each stage's bytes; the gate_up's A is a row gather, which
Hopper's TMA cannot do); act stored at the pairs' sorted positions (MoeConfig.sorted_act: contiguous rows, the
down's A through TMA too; a tie with the default in session 4's runs, so off); every kernel launched as a programmatic
dependent (MoeConfig.pdl: it may start while the kernel ahead finishes and waits for it before any global access;
on at decode sizes, session 5: 109.2 vs 112.1 us at D = 2048, T = 64).
moe_config (kernels/moe_config.py) may instead pick the gemv path (kernels/moe_gemv.py): no align, two
launches (T = 1 at I <= 256).
The y [M, D] round trip stays. Measured (bench/NOTES.md "Fused MoE, session 3" run 5, commit 6c060c6): the
down's epilogue adding its weighted rows in fp32 into a zeroed [T, D] buffer with tl.atomic_add (then one cast)
was slower everywhere on the H200: down + adds 2.24 ms vs down 1.85 + sum 0.13 at E = 32 / T = 4k (pipeline
5.78 vs 5.75 ms), 8.68 vs 7.01 + 0.49 at 16k, 0.79 vs 0.48 + 0.13 at E = 256 / 4k (1.52 vs 1.27 ms). A
token's K pairs sit in K experts' blocks far apart in launch order: the adds (940 MB of fp32 at 4k) cost the
down 0.32-0.39 ms more than its bf16 y store (2.2-3.0 TB/s of adds at 4k and 16k), not hidden under the
product; and their order varies (two calls at E = 256 gave different bits).
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from r3trace.kernels.contract import FLOAT_DTYPES, require, require_tensor
from r3trace.kernels.moe.align import has_pdl, moe_align, moe_align_ref
from r3trace.kernels.moe.config import (
    AlignTile,
    GemmTile,
    GemvTile,
    MoeConfig,
    grouped_config,
    moe_config,
    same_tiles,
)
from r3trace.kernels.moe.gemm import moe_down, moe_gate_up
from r3trace.kernels.moe.gemv import gemv_moe

__all__ = [
    "AlignTile", "GemmTile", "GemvTile", "MoeConfig", "fused_moe", "fused_moe_ref", "grouped_config", "moe_config",
    "moe_down", "moe_gate_up", "moe_sum", "same_tiles",
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
    if cfg.gemv is not None:  # kernels/moe_gemv.py: no alignment (the align argument has nothing to pick)
        return gemv_moe(hidden, w13, w2, topk_ids, topk_weights, cfg.gemv)
    if align == "triton":
        alignment = moe_align(topk_ids, E, cfg.block_m, tile=cfg.align, pdl=cfg.pdl)
    else:
        alignment = moe_align_ref(topk_ids, E, cfg.block_m)
    act = moe_gate_up(hidden, w13, alignment, K, cfg.block_m, cfg.gate_up, cfg.sorted_act, cfg.pdl)
    y = moe_down(act, w2, alignment, topk_weights, cfg.block_m, cfg.down, cfg.sorted_act, T * K, cfg.pdl)
    return moe_sum(y, topk_ids, cfg.pdl)


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Per-expert loop in torch (the engine's reference MoE, and bench's baseline); fp32 accumulation."""
    _check_moe_args(hidden, w13, w2, topk_ids, topk_weights)
    I = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, D]
    for e in range(w13.shape[0]):
        rows, ks = torch.where(topk_ids == e)  # [n], [n]
        if rows.numel() == 0:
            continue
        gate_up = hidden[rows] @ w13[e].T  # [n, 2I]
        act = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]  # [n, I]
        y = (act @ w2[e].T).float() * topk_weights[rows, ks, None]  # [n, D]
        out.index_add_(0, rows, y)
    return out.to(hidden.dtype)
