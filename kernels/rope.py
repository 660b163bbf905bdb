"""Rotary embedding over interleaved pairs: one launch instead of ~12 torch kernels per call.

Shape legend: T tokens, H heads (1 for the shared key), R rope dims (pairs (x0, x1), (x2, x3), ...).
Semantics (the reference below, DeepSeek's interleaved layout): for pair j at position p,
    out[2j]   = x[2j] cos[p, j] - x[2j+1] sin[p, j]
    out[2j+1] = x[2j+1] cos[p, j] + x[2j] sin[p, j]
computed in fp32, rounded to x.dtype. cos/sin [P, R/2] fp32 are precomputed (YaRN scaling folded in).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import FLOAT_DTYPES, INDEX_DTYPES, require, require_tensor


def rope_ref(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [T, ..., R] rotated by positions [T] -> a new tensor of x's shape and dtype, or written into out
    (x's shape and dtype, any strides; e.g. the rope columns of the absorbed query) and returned."""
    c, s = cos[positions], sin[positions]  # [T, R/2]
    while c.dim() < x.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    y = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    if out is None:
        return y
    _check_out(x, out)
    return out.copy_(y)


def _check_out(x: torch.Tensor, out: torch.Tensor) -> None:
    require(tuple(out.shape) == tuple(x.shape) and out.dtype == x.dtype and out.device == x.device, (
        f"out: shape {tuple(out.shape)} {out.dtype} on {out.device}, expected x's {tuple(x.shape)} {x.dtype} "
        f"on {x.device}"))  # fmt: skip
    require(out.stride(-1) == 1, f"out: last stride {out.stride(-1)}, must be 1")


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr,
    H, stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF)
    c = tl.load(cos_ptr + p * stride_cs + j)[None, :]  # [1, R/2]
    s = tl.load(sin_ptr + p * stride_cs + j)[None, :]
    h = tl.arange(0, BLOCK_H)
    mask = (h < H)[:, None]
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + 2 * j[None, :]  # [BLOCK_H, R/2] even elements
    xe = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + t * stride_ot + h[:, None] * stride_oh + 2 * j[None, :]
    tl.store(dst, (xe * c - xo * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + 1, (xo * c + xe * s).to(out_ptr.dtype.element_ty), mask=mask)


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as rope_ref for x [T, R] or [T, H, R] (strided rows/heads allowed, unit last stride; out
    too: the kernel stores through its strides, so writing into a slice costs no copy)."""
    require(x.dim() in (2, 3), f"x must be [T, R] or [T, H, R], got shape {tuple(x.shape)}")
    require_tensor("x", x, x.dim(), FLOAT_DTYPES, x.device)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [T, H, R]
    t, h, r = x3.shape
    half = r // 2
    require(r % 2 == 0 and half == triton.next_power_of_2(half), f"rope dims R={r}: must be 2 x a power of 2")
    require_tensor("positions", positions, 1, INDEX_DTYPES, x.device)
    require(positions.shape[0] == t, f"positions has {positions.shape[0]} entries, x has T={t}")
    for name, tab in (("cos", cos), ("sin", sin)):
        require_tensor(name, tab, 2, (torch.float32,), x.device)
        require(tab.shape[1] == half, f"{name} has {tab.shape[1]} columns, expected R/2={half}")
    require(cos.stride() == sin.stride(), f"cos strides {cos.stride()} != sin strides {sin.stride()}")
    if out is None:
        out3 = torch.empty((t, h, r), dtype=x.dtype, device=x.device)
    else:
        _check_out(x, out)
        out3 = out if out.dim() == 3 else out.unsqueeze(1)
    if t:
        _rope_kernel[(t,)](
            x3, positions, cos, sin, out3, h, x3.stride(0), x3.stride(1), out3.stride(0), out3.stride(1),
            cos.stride(0), HALF=half, BLOCK_H=triton.next_power_of_2(h), num_warps=4 if h >= 16 else 1,
        )
    return out if out is not None else out3.view(x.shape)
