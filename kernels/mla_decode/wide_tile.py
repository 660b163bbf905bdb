"""One 64-key tile of the wide Gluon MLA decode stage 1 (wide.py: 64 heads over two warpgroups):

    S [64 heads, 64 keys]  = q_nope @ c_kv^T + q_pe @ k_pe^T   warpgroup w computes keys 32w..32w+31
    P = exp2(S - m)        -> shared memory (bf16), read by both warpgroups
    O [64, kv_lora]       += P @ c_kv                          warpgroup w accumulates columns 256w..256w+255

with the next tile loaded while this one computes, in one of two forms: tile_tma (two TMA boxes on mbarriers,
pages of a multiple of 64 slots) or tile_gather (cp.async row copies through req_to_token, any page size). Gluon
functions inline: the kernel compiles to what it did with these lines in place (checked offline, triton 3.6,
sm_90a: the same SASS). bench/mla_decode_h128.py --parts cuts parts out of this file's source.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from r3trace.kernels.mla_decode.latent_tiles import copy_tile, expect_tile, first_slot, gather_rows, row_slots


@gluon.jit
def scores(qv_s, qr_s, kv_t, kr_t, s_zero):
    """S [64 heads, 64 keys] = q_nope c_kv^T + q_pe k_pe^T, issued asynchronously (warpgroup w: keys 32w..)."""
    s = warpgroup_mma(qv_s, kv_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(qr_s, kr_t.permute((1, 0)), s, is_async=True)


@gluon.jit
def row_max(t, start, end, qk_scale, s, keys, m_i, mx_s, BLOCK_N: gl.constexpr, MAX_XCHG: gl.constexpr):
    """Waits for the scores, masks keys past `end`, and returns them (log2 units) with the new row max. Its
    barrier (MAX_XCHG) also means every warpgroup finished the previous tile's P V."""
    s = warpgroup_mma_wait(0, deps=(s,))
    visible = (start + t * BLOCK_N + keys) < end
    s = gl.where(visible[None, :], s * qk_scale, float("-inf"))  # log2 units
    if MAX_XCHG:
        # [64 heads, 2]: each warpgroup's max over its own 32 keys (a reduction inside each warp), stored
        # warpgroup-major to mx_s [2 x 64], then both halves read back in the rows' own layout
        half = gl.max(gl.reshape(s, [s.shape[0], 2, BLOCK_N // 2]), axis=2)
        mx_s.store(gl.reshape(gl.permute(half, (1, 0)), [2 * s.shape[0]]))
        gl.thread_barrier()
        row: gl.constexpr = m_i.type.layout
        m_tile = gl.maximum(mx_s.slice(0, s.shape[0]).load(row), mx_s.slice(s.shape[0], s.shape[0]).load(row))
        m_new = gl.maximum(m_i, m_tile)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
    return s, m_new


@gluon.jit
def probs_pv(s, m_i, m_new, l_e, acc, p_s, kv_t, O_LAYOUT: gl.constexpr):
    """P = exp2(S - m) through shared memory to both warpgroups, O rescaled, O += P c_kv (waited)."""
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_e = l_e * alpha[:, None] + p
    p_s.store(p.to(kv_t.dtype))
    fence_async_shared()
    gl.thread_barrier()  # both halves of P (one per warpgroup) written before either reads all of it
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    acc = warpgroup_mma(p_s, kv_t, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return l_e, acc


@gluon.jit
def tile_gather(
    t, start, end, qk_scale, qv_s, qr_s, mx_s, kv_t, kr_t, kv_n, kr_n, p_s, kv_ptr, r2t, stride_kvs,
    sl_v, sl_r, m_v, m_r, rows_v, rows_r, cols_v, cols_r, keys, s_zero, m_i, l_e, acc,
    BLOCK_N: gl.constexpr, O_LAYOUT: gl.constexpr, MAX_XCHG: gl.constexpr, GATHER_UNDER_S: gl.constexpr,
):  # fmt: skip
    """cp.async form (any page size): one 64-key tile t from (kv_t, kr_t), with tile t+1's gather, one row
    copy per key, issued into (kv_n, kr_n). The two buffers are separate allocations, and the loop calls this
    twice an iteration with them swapped: with one [2, ...] allocation indexed by t % 2, the compiler's
    shared-memory hazard analysis cannot tell the buffer being filled from the one being read and adds a
    barrier between the gather and the scores (and one more before the wait; 6 barriers a tile with one
    allocation, 4 with two, in the SASS). Leaving a tile's P V running under the next tile's scores (one
    transition in two: across the loop's back edge ptxas serialises every wgmma) was 1-4% slower."""
    async_copy.wait_group(0)  # this thread's copies of tile t (and q) landed: the only group in flight
    fence_async_shared()  # cp.async and P stores are generic-proxy writes; wgmma reads async
    # every thread's copies of tile t landed, and every warpgroup waited for its P V of tile t-1, so the
    # other buffer and P are free: one barrier where there were two (refill, then data)
    gl.thread_barrier()
    if GATHER_UNDER_S:  # the scores first: the gather's ~20 instructions a thread issue while they run
        s = scores(qv_s, qr_s, kv_t, kr_t, s_zero)
    gather_rows(kv_n, kr_n, kv_ptr, sl_v, sl_r, m_v, m_r, cols_v, cols_r, stride_kvs)
    async_copy.commit_group()
    n2 = start + (t + 2) * BLOCK_N  # tile t+2's slots, for the gather the next call issues
    sl_v, sl_r, m_v, m_r = row_slots(r2t, n2, rows_v, rows_r, end, gl.int64)
    if not GATHER_UNDER_S:
        s = scores(qv_s, qr_s, kv_t, kr_t, s_zero)
    s, m_new = row_max(t, start, end, qk_scale, s, keys, m_i, mx_s, BLOCK_N, MAX_XCHG)
    l_e, acc = probs_pv(s, m_i, m_new, l_e, acc, p_s, kv_t, O_LAYOUT)
    return sl_v, sl_r, m_v, m_r, m_new, l_e, acc


@gluon.jit
def tile_tma(
    t, start, end, num_tiles, qk_scale, qv_s, qr_s, mx_s, kv_t, kr_t, bv_t, br_t, kv_n, kr_n, bv_n, br_n, p_s,
    kv_desc, kr_desc, r2t, slot_n, keys, s_zero, m_i, l_e, acc,
    KV_LORA: gl.constexpr, BLOCK_N: gl.constexpr, O_LAYOUT: gl.constexpr, MAX_XCHG: gl.constexpr,
):  # fmt: skip
    """TMA form (page size a multiple of 64: a tile's 64 keys are 64 consecutive cache rows, slot_n.. for tile
    t+1): tile t waited on its mbarriers, tile t+1 loaded as two TMA boxes (c_kv [64, kv_lora], k_pe [64,
    rope]) completing on bv_n / br_n. No per-thread gather (cp.async took ~20 instructions a thread a tile),
    no cp.async wait and no barrier for the data: each thread waits on the mbarriers. 3 barriers a tile: the
    refill must follow one (the other warpgroup may be reading that buffer in its P V of tile t-1); issuing
    it after the row max's instead (2 barriers, ~half a tile less lead) was 0-6% slower at 9 of 10 H = 128 cells;
    issuing it before the wait for tile t was 0-3% slower at 9 of 10. Triton 3.6's barrier analysis puts a barrier
    between any two accesses of one mbarrier allocation (3.7 skips them again, its release notes: canSkipBarSync),
    so each box has its own mbarrier and the expects come before the CTA barrier the copies follow (PTX checked)."""
    more = t + 1 < num_tiles
    expect_tile(kv_desc, kr_desc, bv_n, br_n, more)
    gl.thread_barrier()  # every warpgroup waited for its P V of tile t-1: the other buffer is free
    mbarrier.wait(bv_t, (t // 2) & 1)  # tile t's boxes (and q's, with tile 0) landed: the (t // 2)-th phase
    mbarrier.wait(br_t, (t // 2) & 1)
    s = scores(qv_s, qr_s, kv_t, kr_t, s_zero)
    copy_tile(kv_desc, kr_desc, bv_n, br_n, kv_n, kr_n, slot_n, more, KV_LORA)  # under the score wgmmas
    n2 = start + (t + 2) * BLOCK_N  # tile t+2's first slot, for the refill the next call issues
    slot_n2 = first_slot(r2t, n2, end)
    s, m_new = row_max(t, start, end, qk_scale, s, keys, m_i, mx_s, BLOCK_N, MAX_XCHG)
    l_e, acc = probs_pv(s, m_i, m_new, l_e, acc, p_s, kv_t, O_LAYOUT)
    return slot_n2, m_new, l_e, acc
