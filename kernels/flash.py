"""What the attention kernels share: the latent-tile gather with its scores (decode and extend), and the
online-softmax step (all three; flash attention's running max and sum), in two orientations: query rows
major (scores [M, N]) and keys major (scores [N, M], the transposed product decode can use).

qk arrives in log2 units (scores x sm_scale x log2 e) with invisible keys at -inf; m_i [M] is the running
maximum, l_i [M] the running sum of exp2, acc [M, C] the running weighted sum of values, all fp32.
A row whose every key so far was invisible keeps m_i = -inf; callers never let a whole row stay masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from r3trace.kernels.dot import mma

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); exp2 is the native instruction


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


@triton.jit
def online_softmax_step_keys_major(st, v, m_i, l_i, acc, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """online_softmax_step on transposed scores st [N, M] (keys major): the same (m_i, l_i, acc [M, C])."""
    m_new = tl.maximum(m_i, tl.max(st, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(st - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha[:, None] + mma(tl.trans(p.to(v.dtype)), v, UPCAST, INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def latent_tile_split_scores(
    q_v, q_o, q_pe, rows, offs_v, v_mask, offs_o, o_mask, offs_r, r_mask, n_mask,
    V_SPLITS: tl.constexpr, KEYS_MAJOR: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Decode's tile: gathered rows [N, 1] (pointers) of the latent cache -> (unscaled scores, this program's
    value columns kv [N, V]). Scores are [M, N] or, KEYS_MAJOR, [N, M]; with V_SPLITS = 2 the other half of
    c_kv (offs_o, q_o) is loaded for the scores only. Masked keys load zeros; the caller masks their scores."""
    kv = tl.load(rows + offs_v[None, :], mask=n_mask[:, None] & v_mask[None, :], other=0.0)
    k_pe = tl.load(rows + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    if KEYS_MAJOR:
        s = mma(kv, tl.trans(q_v), UPCAST, INPUT_PRECISION)
        s += mma(k_pe, tl.trans(q_pe), UPCAST, INPUT_PRECISION)
    else:
        s = mma(q_v, tl.trans(kv), UPCAST, INPUT_PRECISION)
        s += mma(q_pe, tl.trans(k_pe), UPCAST, INPUT_PRECISION)
    if V_SPLITS == 2:
        kv_o = tl.load(rows + offs_o[None, :], mask=n_mask[:, None] & o_mask[None, :], other=0.0)
        if KEYS_MAJOR:
            s += mma(kv_o, tl.trans(q_o), UPCAST, INPUT_PRECISION)
        else:
            s += mma(q_o, tl.trans(kv_o), UPCAST, INPUT_PRECISION)
    return s, kv
