"""What the attention kernels share: the latent-tile gather with its scores (decode and extend), and the
online-softmax step (all three; flash attention's running max and sum).

qk arrives in log2 units (scores x sm_scale x log2 e) with invisible keys at -inf; m_i [M] is the running
maximum, l_i [M] the running sum of exp2, acc [M, C] the running weighted sum of values, all fp32.
A row whose every key so far was invisible keeps m_i = -inf; callers never let a whole row stay masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from r3trace.kernels.dot import mma


@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One key tile: qk [M, N] scores, v [N, C] values -> updated (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST, INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def latent_tile_scores(
    q_nope, q_pe, kv_ptr, req_to_token_ptr, req_row, offs_n, n_mask, offs_c, c_mask, offs_r, r_mask,
    stride_kvs, stride_rtr, KV_LORA, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Gather keys offs_n [N] of one request from the paged latent cache -> (unscaled scores [M, N] fp32,
    their latent values kv [N, C]). Masked keys load zeros; the caller masks their scores."""
    slots = tl.load(req_to_token_ptr + req_row * stride_rtr + offs_n, mask=n_mask, other=0).to(tl.int64)
    kv_rows = kv_ptr + slots[:, None] * stride_kvs
    kv = tl.load(kv_rows + offs_c[None, :], mask=n_mask[:, None] & c_mask[None, :], other=0.0)
    k_pe = tl.load(kv_rows + KV_LORA + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    qk = mma(q_nope, tl.trans(kv), UPCAST, INPUT_PRECISION)
    qk += mma(q_pe, tl.trans(k_pe), UPCAST, INPUT_PRECISION)
    return qk, kv
