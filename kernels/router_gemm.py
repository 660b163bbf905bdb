"""Router logits in fp32 from bf16 hidden states in one launch: logits = x.float() @ weight.T.

Shape legend: T tokens, D hidden, E routed experts. DeepSeek and transformers keep the gate in fp32, and the
reference twin is exactly their `F.linear(x.float(), weight)`. On the H200 at a decode step (T = 64, D = 2048,
E = 64) that is three kernels a MoE layer: the cast (3.1 us), cuBLAS's fp32 SIMT GEMM (6.0 us) and its split-K
reduce (2.4 us), 11.4 us x 11 layers = 0.13 ms of a 2.4 ms step (bench/NOTES.md, "Engine owner, session 6",
run 2). Here the cast happens in registers (bf16 -> fp32 is exact) and products accumulate in fp32, never
TF32 (its 10-bit mantissa would move logits by ~1e-3 and flip routes): bf16 rows take three bf16 tensor-core
dots against the fp32 weight split into three bf16 parts (exact, see the kernel), other dtypes fp32 FMA dots
(`input_precision="ieee"`, 4x slower on the H200: 43 vs 11 us, run 3). Each program owns a [BLOCK_T, BLOCK_E] tile over the whole of D, so there is no split-K pass and the result
does not depend on the launch (same inputs, same bits). The summation order differs from cuBLAS's, so logits
agree with the reference to fp32 rounding (~1e-6 relative at D = 2048), not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import FLOAT_DTYPES, require, require_tensor


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, D] any float dtype, weight: [E, D] fp32 -> logits [T, E] fp32."""
    return torch.nn.functional.linear(x.float(), weight)


@dataclass(frozen=True)
class RouterTile:
    block_t: int = 16
    block_e: int = 16
    block_d: int = 128
    warps: int = 4
    stages: int = 3


def default_router_tile(t: int, e: int) -> RouterTile:
    """Small T: 16 x 16 tiles give E/16 x T/16 programs (16 at T = E = 64), each streaming D once."""
    return RouterTile()


@triton.jit
def _router_kernel(
    x_ptr, w_ptr, out_ptr, T, E, D, stride_x, stride_w, stride_out,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT3: tl.constexpr,
    PARTS_AS_F32: tl.constexpr,
):  # fmt: skip
    pid_e = tl.program_id(0)
    pid_t = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < T
    e_ok = offs_e < E
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + offs_e.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_ok = d0 + offs_d < D
        x = tl.load(x_rows + (d0 + offs_d)[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_rows + (d0 + offs_d)[None, :], mask=e_ok[:, None] & d_ok[None, :], other=0.0)
        if SPLIT3:
            # w = hi + mid + lo exactly (3 x 8 significant bits = fp32's 24), and a bf16 x times each part is exact
            # in fp32: three bf16 tensor-core dots with fp32 accumulation give an fp32 dot of the exact products.
            hi = w.to(tl.bfloat16)
            r = w - hi.to(tl.float32)
            mid = r.to(tl.bfloat16)
            lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
            if PARTS_AS_F32:  # the CPU interpreter has no bf16 dot: the same exact parts, multiplied in fp32
                xf = x.to(tl.float32)
                acc = tl.dot(xf, tl.trans(hi.to(tl.float32)), acc, input_precision="ieee")
                acc = tl.dot(xf, tl.trans(mid.to(tl.float32)), acc, input_precision="ieee")
                acc = tl.dot(xf, tl.trans(lo.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(hi), acc)
                acc = tl.dot(x, tl.trans(mid), acc)
                acc = tl.dot(x, tl.trans(lo), acc)
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    out = out_ptr + offs_t.to(tl.int64)[:, None] * stride_out + offs_e[None, :]
    tl.store(out, acc, mask=t_ok[:, None] & e_ok[None, :])


def router_logits(x: torch.Tensor, weight: torch.Tensor, tile: RouterTile | None = None) -> torch.Tensor:
    """Same contract as router_logits_ref; x's rows may be strided."""
    require_tensor("x", x, 2, FLOAT_DTYPES, x.device)
    require_tensor("weight", weight, 2, (torch.float32,), x.device)
    t, d = x.shape
    e = weight.shape[0]
    require(weight.shape[1] == d, f"weight has {weight.shape[1]} features, x has {d}")
    tile = tile or default_router_tile(t, e)
    require(min(tile.block_t, tile.block_e, tile.block_d) >= 16, f"tile {tile}: tl.dot needs every block >= 16")
    out = torch.empty((t, e), dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    grid = (triton.cdiv(e, tile.block_e), triton.cdiv(t, tile.block_t))
    _router_kernel[grid](
        x, weight, out, t, e, d, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_T=tile.block_t, BLOCK_E=tile.block_e, BLOCK_D=tile.block_d, SPLIT3=x.dtype == torch.bfloat16,
        PARTS_AS_F32=not x.is_cuda,
        num_warps=tile.warps,
        num_stages=tile.stages,
    )  # fmt: skip
    return out
