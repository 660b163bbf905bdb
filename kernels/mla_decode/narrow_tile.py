"""One 64-key tile of the narrow Gluon MLA decode stage 1 (narrow.py), keys-major: the 64 keys are the
wgmma's M (its smallest, 64) and the 16 heads its N, so nothing is padded:

    S^T [64 keys, 16 heads]   = c_kv k-tile @ q_nope^T + k_pe @ q_pe^T    A = the latent tile, B = q (smem)
    P^T = exp2(S^T - m)       -> shared memory (bf16, 2 KB)
    O^T [kv_lora, 16 heads]  += c_kv^T @ P^T                               A = the same tile, transposed

36 + 32 wgmma instructions with both operands in shared memory; the softmax needs 2 barriers (the column max
exchanged between the 4 warps, each holding 16 keys; P^T written), plus one before the refill. The next tile is
loaded in one of two forms (tile_tma: TMA boxes on mbarriers; tile_gather: cp.async row copies), each issued while
this tile computes. Gluon functions inline: the kernel compiles to what it did with these lines in place (checked
offline, triton 3.6, sm_90a: the same SASS).
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
def softmax_pv(t, start, end, qk_scale, s, mx_s, p_s, kv_t, keys, m_i, l_e, acc, BLOCK_N: gl.constexpr,
               BLOCK_H: gl.constexpr, O_LAYOUT: gl.constexpr):  # fmt: skip
    """Waits for S^T, masks keys past `end`, updates the online softmax and runs O^T += c_kv^T P^T (waited).
    Its first barrier (the column max's) also means every warp waited for its P V of tile t-1."""
    s = warpgroup_mma_wait(0, deps=(s,))
    visible = (start + t * BLOCK_N + keys) < end
    s = gl.where(visible[:, None], s * qk_scale, float("-inf"))  # [keys, heads], log2 units
    # the column max over 64 keys: each warp's over its 16 (shuffles), then the 4 swapped through 256 B of
    # shared memory with one barrier (gl.max over axis 0 crosses the warps with two)
    warp_max = gl.max(gl.reshape(s, [4, BLOCK_N // 4, BLOCK_H]), axis=1)  # [4 warps, heads]
    mx_s.store(gl.reshape(warp_max, [4 * BLOCK_H]))
    gl.thread_barrier()
    col: gl.constexpr = m_i.type.layout
    m_tile = gl.maximum(
        gl.maximum(mx_s.slice(0, BLOCK_H).load(col), mx_s.slice(BLOCK_H, BLOCK_H).load(col)),
        gl.maximum(mx_s.slice(2 * BLOCK_H, BLOCK_H).load(col), mx_s.slice(3 * BLOCK_H, BLOCK_H).load(col)),
    )
    m_new = gl.maximum(m_i, m_tile)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    l_e = l_e * alpha[None, :] + p  # row sums kept element-wise, summed over the keys once after the loop
    p_s.store(p.to(kv_t.dtype))
    fence_async_shared()  # generic-proxy stores, read by the async proxy (wgmma)
    gl.thread_barrier()  # all 64 keys of P^T written (and every warp read mx_s)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, O_LAYOUT))[None, :]
    acc = warpgroup_mma(kv_t.permute((1, 0)), p_s, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return m_new, l_e, acc


@gluon.jit
def scores(kv_t, kr_t, qv_s, qr_s, s_zero):
    """S^T [64 keys, 16 heads] = c_kv q_nope^T + k_pe q_pe^T, issued asynchronously."""
    s = warpgroup_mma(kv_t, qv_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(kr_t, qr_s.permute((1, 0)), s, is_async=True)


@gluon.jit
def tile_tma(
    t, start, end, num_tiles, qk_scale, qv_s, qr_s, mx_s, p_s, kv_t, kr_t, bv_t, br_t, kv_n, kr_n, bv_n, br_n,
    kv_desc, kr_desc, r2t, slot_n, keys, s_zero, m_i, l_e, acc,
    KV_LORA: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, O_LAYOUT: gl.constexpr,
):  # fmt: skip
    """TMA form: tile t from (kv_t, kr_t), tile t+1's boxes issued into (kv_n, kr_n) after a barrier at the top of
    the tile (every warp finished P V of t-1). Issuing them after the column max's barrier instead (2 barriers a
    tile, the refill the score wgmmas later) was 3-11% slower at B16/1k, B16/8k and B64/1k."""
    more = t + 1 < num_tiles
    expect_tile(kv_desc, kr_desc, bv_n, br_n, more)
    gl.thread_barrier()  # every warp waited for its P V of tile t-1: the other stage is free
    copy_tile(kv_desc, kr_desc, bv_n, br_n, kv_n, kr_n, slot_n, more, KV_LORA)
    mbarrier.wait(bv_t, (t // 2) & 1)  # tile t's boxes (and q's, with tile 0) landed: the (t // 2)-th phase
    mbarrier.wait(br_t, (t // 2) & 1)
    s = scores(kv_t, kr_t, qv_s, qr_s, s_zero)
    n2 = start + (t + 2) * BLOCK_N  # tile t+2's first slot, for the refill of the next call
    slot_n2 = first_slot(r2t, n2, end)
    m_new, l_e, acc = softmax_pv(t, start, end, qk_scale, s, mx_s, p_s, kv_t, keys, m_i, l_e, acc,
                                 BLOCK_N, BLOCK_H, O_LAYOUT)  # fmt: skip
    return slot_n2, m_new, l_e, acc


@gluon.jit
def tile_gather(
    t, start, end, qk_scale, qv_s, qr_s, mx_s, p_s, kv_t, kr_t, kv_n, kr_n, kv_ptr, r2t, stride_kvs,
    sl_v, sl_r, m_v, m_r, rows_v, rows_r, cols_v, cols_r, keys, s_zero, m_i, l_e, acc,
    BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, O_LAYOUT: gl.constexpr,
):  # fmt: skip
    """cp.async form (any page size): tile t from (kv_t, kr_t); tile t+1 gathered row by row through req_to_token
    into (kv_n, kr_n), issued under tile t's score wgmmas (the wide kernel's GATHER_UNDER_S)."""
    async_copy.wait_group(0)  # this thread's copies of tile t (and q) landed: the only group in flight
    fence_async_shared()  # cp.async and P stores are generic-proxy writes; wgmma reads async
    gl.thread_barrier()  # every thread's copies landed; every warp waited for its P V of t-1: the other stage free
    s = scores(kv_t, kr_t, qv_s, qr_s, s_zero)
    gather_rows(kv_n, kr_n, kv_ptr, sl_v, sl_r, m_v, m_r, cols_v, cols_r, stride_kvs)
    async_copy.commit_group()
    n2 = start + (t + 2) * BLOCK_N  # tile t+2's slots, for the gather the next call issues
    sl_v, sl_r, m_v, m_r = row_slots(r2t, n2, rows_v, rows_r, end, gl.int32)
    m_new, l_e, acc = softmax_pv(t, start, end, qk_scale, s, mx_s, p_s, kv_t, keys, m_i, l_e, acc,
                                 BLOCK_N, BLOCK_H, O_LAYOUT)  # fmt: skip
    return sl_v, sl_r, m_v, m_r, m_new, l_e, acc
