"""Prefill attention in the normal MHA form (prefix-free prefill; the absorbed form over a cache: mla_extend.py).

Shape legend: T new tokens (all requests), B requests, H heads.

Each request's tokens attend causally to the request's own tokens. q, k [T, H, Dqk], v [T, H, Dv] ->
out [T, H, Dv]; Dqk (192 in DeepSeek: 128 nope + 64 rope) and Dv (128) need not be powers of two: the tiles
are padded to the next one and masked. Program (b, block of BLOCK_M tokens, head), online softmax in fp32
(exp2, the scale folded into log2 units), keys walked only up to the last query row of the block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import FLOAT_DTYPES, INDEX_DTYPES, grid_len, require, require_tensor
from r3trace.kernels.dot import dot_precision, mma
from r3trace.kernels.flash import LOG2E, online_softmax_step


@triton.jit
def _mha_prefill_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, out_ptr, start_loc_ptr, extend_lens_ptr,
    # sizes
    DQK, DV, qk_scale,
    # strides
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    # constexpr
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    ext = tl.load(extend_lens_ptr + b).to(tl.int32)
    if mb * BLOCK_M >= ext:
        return
    start_loc = tl.load(start_loc_ptr + b).to(tl.int64)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DQK)
    offs_v = tl.arange(0, BLOCK_DV)
    m_mask = offs_m < ext
    d_mask = offs_d < DQK
    v_mask = offs_v < DV
    q = tl.load(
        q_ptr + (start_loc + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )  # fmt: skip

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    kv_end = tl.minimum((mb + 1) * BLOCK_M, ext)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        rows = (start_loc + offs_n)[:, None]
        k = tl.load(k_ptr + rows * stride_kt + h * stride_kh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
        v = tl.load(v_ptr + rows * stride_vt + h * stride_vh + offs_v[None, :],
                    mask=n_mask[:, None] & v_mask[None, :], other=0.0)  # fmt: skip
        qk = mma(q, tl.trans(k), UPCAST, INPUT_PRECISION)
        # rows past ext compare against offs_m >= ext > every offs_n: never all-masked
        visible = n_mask[None, :] & (offs_n[None, :] <= offs_m[:, None])
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, UPCAST, INPUT_PRECISION)

    out = acc / l_i[:, None]
    o_rows = out_ptr + (start_loc + offs_m)[:, None] * stride_ot + h * stride_oh
    o_mask = m_mask[:, None] & v_mask[None, :]
    tl.store(o_rows + offs_v[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)


def _check_prefill_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_lens: torch.Tensor,
) -> None:
    dev = q.device
    require_tensor("q", q, 3, FLOAT_DTYPES, dev)
    require_tensor("k", k, 3, (q.dtype,), dev)
    require_tensor("v", v, 3, (q.dtype,), dev)
    require_tensor("extend_start_loc", extend_start_loc, 1, INDEX_DTYPES, dev)
    require_tensor("extend_lens", extend_lens, 1, INDEX_DTYPES, dev)
    require(k.shape == q.shape, f"k shape {tuple(k.shape)} != q shape {tuple(q.shape)}")
    require(v.shape[:2] == q.shape[:2], f"v shape {tuple(v.shape)} != q's [T, H] {tuple(q.shape[:2])}")
    require(extend_start_loc.shape == extend_lens.shape, "extend_start_loc and extend_lens differ in length")


def mha_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """q, k: [T, H, Dqk], v: [T, H, Dv] -> [T, H, Dv]; causal within each request, no cached prefix."""
    _check_prefill_args(q, k, v, extend_start_loc, extend_lens)
    T, H, dqk = q.shape
    dv = v.shape[2]
    out = torch.empty((T, H, dv), dtype=q.dtype, device=q.device)
    B = extend_lens.shape[0]
    max_len = grid_len(extend_lens, max_extend_len)
    if T == 0 or B == 0 or max_len == 0:
        return out
    block_m, block_n = 64, 32
    grid = (B, triton.cdiv(max_len, block_m), H)
    _mha_prefill_kernel[grid](
        q, k, v, out, extend_start_loc, extend_lens,
        dqk, dv, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DQK=max(16, triton.next_power_of_2(dqk)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        UPCAST=not q.is_cuda, INPUT_PRECISION=dot_precision(q.dtype == torch.float32),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


def mha_prefill_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Per-request causal softmax attention in fp32. Same contract as mha_prefill."""
    _check_prefill_args(q, k, v, extend_start_loc, extend_lens)
    out = torch.empty((*q.shape[:2], v.shape[2]), dtype=q.dtype, device=q.device)
    for b in range(extend_lens.shape[0]):
        s0, n = int(extend_start_loc[b]), int(extend_lens[b])
        if n == 0:
            continue
        qb, kb, vb = (x[s0 : s0 + n].float().transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        scores = (qb @ kb.transpose(1, 2)) * sm_scale  # [H, n, n]
        hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)  # [n, n]
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[s0 : s0 + n] = (probs @ vb).transpose(0, 1).to(q.dtype)  # [n, H, Dv]
    return out
