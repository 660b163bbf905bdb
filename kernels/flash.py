"""The online-softmax step the three attention kernels share (flash attention's running max and sum).

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
