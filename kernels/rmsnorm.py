"""RMSNorm, optionally fused with the residual add before it: one launch instead of 7-8 torch kernels.

Shape legend: T rows (tokens), D features. Semantics are DeepSeek's and transformers' (the reference below):
    r   = x + residual            (rounded to x.dtype, when a residual is given)
    out = weight * (r_f32 * rsqrt(mean(r_f32^2) + eps)).to(dtype)
A decode step of a 12-layer V3-shaped model runs 4 norms and 2 residual adds per layer; in torch that is
~35 tiny kernels a layer at ~1.5-2 us each under a CUDA graph (bench/step_profile.py), ~0.5 ms of a 5 ms step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import FLOAT_DTYPES, require, require_tensor


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, D] (, residual [T, D]) -> (out [T, D], the normalised input r = x + residual, or x)."""
    r = x if residual is None else x + residual
    rf = r.float()
    rf = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * rf.to(r.dtype), r


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, r_out_ptr,
    D, stride_x, stride_res, stride_out, stride_r_out, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(r_out_ptr.dtype.element_ty)  # rounded as torch's add
        tl.store(r_out_ptr + row * stride_r_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = (xf * rstd).to(out_ptr.dtype.element_ty)  # the reference casts before scaling by the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rmsnorm_ref. Rows may be strided (e.g. a column slice of a projection's output)."""
    require_tensor("x", x, 2, FLOAT_DTYPES, x.device)
    t, d = x.shape
    require_tensor("weight", weight, 1, (x.dtype,), x.device)
    require(weight.shape[0] == d, f"weight has {weight.shape[0]} features, x has {d}")
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    r_out = x
    if residual is not None:
        require_tensor("residual", residual, 2, (x.dtype,), x.device)
        require(tuple(residual.shape) == (t, d), f"residual shape {tuple(residual.shape)} != x shape {(t, d)}")
        r_out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    if t == 0:
        return out, r_out
    block = triton.next_power_of_2(d)
    # 8 warps keep a 7168-wide row at 28 values a thread; narrow rows need fewer.
    warps = 8 if block >= 4096 else 4 if block >= 1024 else 1
    res = residual if residual is not None else x
    _rmsnorm_kernel[(t,)](
        x, res, weight, out, r_out, d, x.stride(0), res.stride(0), out.stride(0), r_out.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK_D=block, num_warps=warps,
    )
    return out, r_out
