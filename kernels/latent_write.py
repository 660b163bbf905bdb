"""MLA latent-cache write: kv_a RMSNorm + RoPE of the shared key + store into the paged cache, one launch.

Shape legend: T new tokens, L = kv_lora_rank, R = qk_rope_head_dim, C = L + R (one latent cache row),
S cache slots. kv_a is kv_a_proj_with_mqa's output [T, C]: c_kv in columns [0, L), k_pe in [L, C).
Semantics (latent_write_ref below: norm, rope, cat, index store):
    row = [rmsnorm(c_kv) (r3trace.kernels.rmsnorm), rope(k_pe, positions) (r3trace.kernels.rope)]
    kv_cache[out_cache_loc[t]] = row[t].to(kv_cache.dtype)
and, where the normal (prefix-free prefill) path reads the new keys, latent [T, C] = the same rows.
At batch 64 the reference is 4 kernels a layer (norm, rope, cat, index_put: 1.7 + 2.0 + 1.3 + 3.8 us under
the decode graph on an H200, BENCHMARKS.md#end-to-end), ~106 us of a 2.41 ms step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import FLOAT_DTYPES, INDEX_DTYPES, require, require_tensor
from r3trace.kernels.rmsnorm import rmsnorm_ref
from r3trace.kernels.rope import rope_ref


@triton.jit
def _latent_write_kernel(
    # pointers
    kv_a_ptr, norm_w_ptr, pos_ptr, cos_ptr, sin_ptr, loc_ptr, cache_ptr, latent_ptr,
    # sizes
    L, eps,
    # strides
    stride_at, stride_cs, stride_kv, stride_lt,
    # constexpr
    HALF: tl.constexpr, BLOCK_L: tl.constexpr, WRITE_LATENT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    row = kv_a_ptr + t * stride_at
    slot = tl.load(loc_ptr + t).to(tl.int64)
    dst = cache_ptr + slot * stride_kv
    io_ty = kv_a_ptr.dtype.element_ty

    # kv_a RMSNorm over c_kv [L]: as rmsnorm.py, the normalised row is rounded to the input dtype before
    # the weight multiplies it (the reference's order), then rounded again to the cache dtype.
    offs = tl.arange(0, BLOCK_L)
    mask = offs < L
    xf = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / L + eps)
    y = (xf * rstd).to(io_ty).to(tl.float32)
    w = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    normed = (w * y).to(io_ty)
    tl.store(dst + offs, normed.to(cache_ptr.dtype.element_ty), mask=mask)
    if WRITE_LATENT:
        tl.store(latent_ptr + t * stride_lt + offs, normed.to(latent_ptr.dtype.element_ty), mask=mask)

    # RoPE of k_pe [R], interleaved pairs (x[2j], x[2j+1]) at this token's position, in fp32 (rope.py)
    p = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF)
    c = tl.load(cos_ptr + p * stride_cs + j)
    s = tl.load(sin_ptr + p * stride_cs + j)
    xe = tl.load(row + L + 2 * j).to(tl.float32)
    xo = tl.load(row + L + 2 * j + 1).to(tl.float32)
    ye = (xe * c - xo * s).to(io_ty)
    yo = (xo * c + xe * s).to(io_ty)
    tl.store(dst + L + 2 * j, ye.to(cache_ptr.dtype.element_ty))
    tl.store(dst + L + 2 * j + 1, yo.to(cache_ptr.dtype.element_ty))
    if WRITE_LATENT:
        tl.store(latent_ptr + t * stride_lt + L + 2 * j, ye.to(latent_ptr.dtype.element_ty))
        tl.store(latent_ptr + t * stride_lt + L + 2 * j + 1, yo.to(latent_ptr.dtype.element_ty))


def _check(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_cache_loc: torch.Tensor,
    kv_cache: torch.Tensor,
) -> tuple[int, int]:
    """-> (L, R) after checking every shape, dtype, device and stride the kernel relies on."""
    dev = kv_a.device
    require_tensor("kv_a", kv_a, 2, FLOAT_DTYPES, dev)
    t, c = kv_a.shape
    require_tensor("norm_weight", norm_weight, 1, (kv_a.dtype,), dev)
    lora = norm_weight.shape[0]
    r = c - lora
    half = r // 2
    require(r > 0 and r % 2 == 0 and half == triton.next_power_of_2(half),
            f"kv_a has {c} columns, norm_weight {lora}: rope dims R={r} must be 2 x a power of 2")
    require_tensor("positions", positions, 1, INDEX_DTYPES, dev)
    require_tensor("out_cache_loc", out_cache_loc, 1, INDEX_DTYPES, dev)
    require(positions.shape[0] == t and out_cache_loc.shape[0] == t,
            f"positions has {positions.shape[0]}, out_cache_loc {out_cache_loc.shape[0]} entries, kv_a has T={t}")
    for name, tab in (("cos", cos), ("sin", sin)):
        require_tensor(name, tab, 2, (torch.float32,), dev)
        require(tab.shape[1] == half, f"{name} has {tab.shape[1]} columns, expected R/2={half}")
    require(cos.stride() == sin.stride(), f"cos strides {cos.stride()} != sin strides {sin.stride()}")
    require_tensor("kv_cache", kv_cache, 2, FLOAT_DTYPES, dev)
    require(kv_cache.shape[1] == c, f"kv_cache rows have {kv_cache.shape[1]} columns, kv_a has C={c}")
    return lora, r


def latent_write(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_cache_loc: torch.Tensor,
    kv_cache: torch.Tensor,
    return_latent: bool = False,
) -> torch.Tensor | None:
    """Same contract as latent_write_ref. kv_a rows may be strided; out_cache_loc must be distinct slots
    (each program writes its own row; duplicates would race, and the engine never hands out a slot twice)."""
    lora, r = _check(kv_a, norm_weight, positions, cos, sin, out_cache_loc, kv_cache)
    t = kv_a.shape[0]
    latent = torch.empty((t, lora + r), dtype=kv_cache.dtype, device=kv_a.device) if return_latent else None
    if t == 0:
        return latent
    block = triton.next_power_of_2(lora)
    # One warp, as rmsnorm.py gives a 512-wide row: the same layout sums the squares in the same order, so the
    # cache rows are bit-identical to the norm + rope + cat + store path's (18 values a thread; 2.3 us a call
    # at 4 warps and T=64 on an H200, a latency-bound launch either way).
    warps = 8 if block >= 4096 else 4 if block >= 1024 else 1
    lat = latent if latent is not None else kv_cache  # unread when WRITE_LATENT=0
    _latent_write_kernel[(t,)](
        kv_a, norm_weight, positions, cos, sin, out_cache_loc, kv_cache, lat,
        lora, eps,
        kv_a.stride(0), cos.stride(0), kv_cache.stride(0), lat.stride(0),
        HALF=r // 2, BLOCK_L=block, WRITE_LATENT=latent is not None, num_warps=warps,
    )  # fmt: skip
    return latent


def latent_write_ref(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_cache_loc: torch.Tensor,
    kv_cache: torch.Tensor,
    return_latent: bool = False,
) -> torch.Tensor | None:
    """kv_a: [T, C] -> kv_cache[out_cache_loc] = [rmsnorm(kv_a[:, :L]), rope(kv_a[:, L:])] in the cache
    dtype (L = len(norm_weight)); returns those rows [T, C] (cache dtype) when return_latent, else None."""
    lora, r = _check(kv_a, norm_weight, positions, cos, sin, out_cache_loc, kv_cache)
    c_kv, k_pe = kv_a.split([lora, r], dim=-1)
    latent = torch.cat([rmsnorm_ref(c_kv, norm_weight, eps)[0], rope_ref(k_pe, positions, cos, sin)], dim=-1)
    latent = latent.to(kv_cache.dtype)  # [T, C]
    kv_cache[out_cache_loc] = latent
    return latent if return_latent else None
