"""Prefill attention in the normal MHA form (the absorbed form over a cache: mla_extend.py).

Shape legend: T new tokens (all requests), B requests, H heads, Nk keys (all requests).

Request b's q_lens[b] queries are the last of its k_lens[b] keys and attend causally: q [T, H, Dqk], k [Nk, H, Dqk],
v [Nk, H, Dv] -> out [T, H, Dv]. Without k_start_loc / k_lens the keys are the queries' own tokens (a prefix-free
prefill, Nk = T). Dqk (192 in DeepSeek: 128 nope + 64 rope) and Dv (128) need not be powers of two: the tiles are
padded to the next one and masked. Program (b, block of BLOCK_M queries, head), online softmax in fp32 (exp2, the
scale folded into log2 units), keys walked from key 0 in BLOCK_N steps up to the block's last query.

A query row's bits follow its own keys only (the row-invariant mode, EngineConfig.row_invariant): key tiles start at
the request's key 0 whatever the block or the chunk the row sits in, each product and reduction is per row, and a
tile past the row's position is all -inf for it (its max stays, alpha = exp2(0) = 1, p = 0: state unchanged), so a
prompt row is the same in a chunk of 7 on top of a cached prefix and in the whole prompt at once.
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
    q_ptr, k_ptr, v_ptr, out_ptr, start_loc_ptr, extend_lens_ptr, k_start_ptr, k_lens_ptr,
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
    k_start = tl.load(k_start_ptr + b).to(tl.int64)
    prefix = tl.load(k_lens_ptr + b).to(tl.int32) - ext  # keys before the first query
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
    kv_end = prefix + tl.minimum((mb + 1) * BLOCK_M, ext)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        rows = (k_start + offs_n)[:, None]
        k = tl.load(k_ptr + rows * stride_kt + h * stride_kh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
        v = tl.load(v_ptr + rows * stride_vt + h * stride_vh + offs_v[None, :],
                    mask=n_mask[:, None] & v_mask[None, :], other=0.0)  # fmt: skip
        qk = mma(q, tl.trans(k), UPCAST, INPUT_PRECISION)
        # rows past ext sit at prefix + offs_m >= kv_end > every offs_n: never all-masked
        visible = n_mask[None, :] & (offs_n[None, :] <= prefix + offs_m[:, None])
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
    k_start_loc: torch.Tensor | None,
    k_lens: torch.Tensor | None,
) -> None:
    dev = q.device
    require_tensor("q", q, 3, FLOAT_DTYPES, dev)
    require_tensor("k", k, 3, (q.dtype,), dev)
    require_tensor("v", v, 3, (q.dtype,), dev)
    require_tensor("extend_start_loc", extend_start_loc, 1, INDEX_DTYPES, dev)
    require_tensor("extend_lens", extend_lens, 1, INDEX_DTYPES, dev)
    require(extend_start_loc.shape == extend_lens.shape, "extend_start_loc and extend_lens differ in length")
    if k_start_loc is None or k_lens is None:
        require(k_start_loc is None and k_lens is None, "k_start_loc and k_lens come together")
        require(k.shape == q.shape, f"k shape {tuple(k.shape)} != q shape {tuple(q.shape)} (no k_lens: no prefix)")
    else:
        for name, t in (("k_start_loc", k_start_loc), ("k_lens", k_lens)):
            require_tensor(name, t, 1, INDEX_DTYPES, dev)
            require(t.shape == extend_lens.shape,
                    f"{name} has {t.shape[0]} requests, extend_lens {extend_lens.shape[0]}")  # fmt: skip
        require(k.shape[1:] == q.shape[1:], f"k shape {tuple(k.shape)} != q's [H, Dqk] {tuple(q.shape[1:])}")
    require(v.shape[:2] == k.shape[:2], f"v shape {tuple(v.shape)} != k's [Nk, H] {tuple(k.shape[:2])}")


def mha_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_lens: torch.Tensor,
    sm_scale: float,
    max_extend_len: int | None = None,
    k_start_loc: torch.Tensor | None = None,
    k_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, Dqk], k [Nk, H, Dqk], v [Nk, H, Dv] -> [T, H, Dv]: request b's extend_lens[b] queries (rows from
    extend_start_loc[b]) are the last of its k_lens[b] keys (rows from k_start_loc[b]), causal. Without k_start_loc /
    k_lens, the keys are the queries' own rows (no prefix)."""
    _check_prefill_args(q, k, v, extend_start_loc, extend_lens, k_start_loc, k_lens)
    if k_start_loc is None or k_lens is None:
        k_start_loc, k_lens = extend_start_loc, extend_lens
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
        q, k, v, out, extend_start_loc, extend_lens, k_start_loc, k_lens,
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
    k_start_loc: torch.Tensor | None = None,
    k_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-request causal softmax attention in fp32. Same contract as mha_prefill."""
    _check_prefill_args(q, k, v, extend_start_loc, extend_lens, k_start_loc, k_lens)
    if k_start_loc is None or k_lens is None:
        k_start_loc, k_lens = extend_start_loc, extend_lens
    out = torch.empty((*q.shape[:2], v.shape[2]), dtype=q.dtype, device=q.device)
    for b in range(extend_lens.shape[0]):
        s0, n = int(extend_start_loc[b]), int(extend_lens[b])
        k0, nk = int(k_start_loc[b]), int(k_lens[b])
        if n == 0:
            continue
        qb = q[s0 : s0 + n].float().transpose(0, 1)  # [H, n, Dqk]
        kb, vb = (x[k0 : k0 + nk].float().transpose(0, 1) for x in (k, v))  # [H, nk, D]
        scores = (qb @ kb.transpose(1, 2)) * sm_scale  # [H, n, nk]
        hidden = torch.ones(n, nk, dtype=torch.bool, device=q.device).triu(nk - n + 1)  # [n, nk]: key j > nk - n + i
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[s0 : s0 + n] = (probs @ vb).transpose(0, 1).to(q.dtype)  # [n, H, Dv]
    return out
