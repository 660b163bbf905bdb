"""MLA decode stage 1 in Gluon for H >= 64 on Hopper ("wide" record): FlashMLA's split of one 64-head tile over two
warpgroups. The default at H >= 64 on Hopper where the seesaw kernel does not apply (pages not a multiple of 64 slots,
or rope other than 64); package docstring.

Shape legend as in decode.py: B requests, H heads, C = kv_lora + rope, P = num_kv_splits; one program =
(64-head block, request, split), 8 warps. Per 64-key tile (wide_tile.py):

    S [64 heads, 64 keys]  = q_nope @ c_kv^T + q_pe @ k_pe^T   warpgroup w computes keys 32w..32w+31
    P = exp2(S - m)        -> shared memory (bf16), read by both warpgroups
    O [64, kv_lora]       += P @ c_kv                          warpgroup w accumulates columns 256w..256w+255

The Triton kernel cannot lay the products out this way: tl.dot puts both warpgroups of a chained product along M, so
at 64 heads both compute the same scores (576 of every 1088 FLOPs twice). Here each FLOP is done once, the wgmmas read
q and the latent tile from shared memory (q 72 KB, two stages of the tile 144 KB, P 8 KB: 224 KB of the 227 KB
allowed), and the next tile is loaded one tile ahead in one of two forms (constexpr TMA, picked by the launcher from
the tile's page size):
- TMA (pages of a multiple of 64 slots, so a tile's keys are 64 consecutive cache rows): a [64, kv_lora] and a
  [64, rope] box on an mbarrier each; q the same way beside tile 0. 3 barriers a tile (the refill's, the row max's,
  P's). 1.08-1.12x the cp.async form at every H = 128 cell.
- cp.async row copies through req_to_token (any page size), one per key: 4 barriers a tile (the refill's and the
  data's in one, one the compiler adds after the cp.async wait, the row max's, P's).
It writes the same partial outputs and log-sum-exps as the Triton stage 1, so the merge (merge.py) is shared. The row
sums need no barrier (kept element-wise, summed once after the loop). A TMA tile's 2.5 us at B = 64 / 8k (each part
cut from the source, the rest timed): the score wgmmas 40% (both warpgroups read all of q: 216 KB of shared-memory
reads a tile of the ~375 KB it moves), P V 18%, HBM 8%, the exponentials and the rescale of O 3% each; the rest is the
softmax, the barriers and waits. Figures: H200, BENCHMARKS.md#mla-decode.

Gluon kernels do not run under TRITON_INTERPRET=1 (gluon.jit launches through the active GPU driver), so this path is
covered by `gpu`-marked tests only. Requires sm_90, bf16/fp16, kv_lora in {128, 256, 512}, rope a power of two in
16..128 (registry.gluon_shape_error).
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from r3trace.kernels.mla_decode.cluster_merge import (
    cluster_merge_nothing,
    cluster_merge_store,
    exchange_bytes,
    launch_in_clusters,
    merge_layout,
)
from r3trace.kernels.mla_decode.latent_tiles import (
    first_slot,
    gather_first_tile,
    gather_layout,
    grid_dependency_wait,
    launch_dependents,
    row_slots,
    split_bounds,
    stage_barriers,
    tile_descriptors,
    tma_first_tile,
    tma_usable,
)
from r3trace.kernels.mla_decode.registry import DecodeShape, Stage1, gluon_shape_error
from r3trace.kernels.mla_decode.tile import DecodeTile
from r3trace.kernels.mla_decode.wide_tile import tile_gather, tile_tma

__all__ = ["STAGE1", "mla_decode_stage1_wide"]

BLOCK_H = 64  # one wgmma M: 4 warps x 16 rows
BLOCK_N = 64  # keys a tile: S is 64 x 64, each warpgroup's half an instruction of N = 32
NUM_WARPS = 8  # two warpgroups, [4, 2]: M over the warps of a group, N over the groups
# The kernel's schedule switches (MAX_XCHG, GATHER_UNDER_S, COALESCED_OUT) are DecodeTile fields, on by default:
# MAX_XCHG: the row max over a tile's 64 keys from each warpgroup's max over its 32, swapped through 512 B of shared
# memory with one barrier, not gl.max's cross-warp reduction (two barriers): 1-4% faster at every H = 128 cell.
# GATHER_UNDER_S (cp.async form): the score wgmmas issued before the next tile's gather, so its ~20 instructions a
# thread issue while they run: 0.3-4% faster at 9 of the 10 H = 128 cells, 0.4% slower at B = 256 / 8k. The TMA form
# always issues its boxes after the score wgmmas.
# COALESCED_OUT: the output (or fp32 partial) converted through shared memory (the dead tile buffers: the kernel's
# 224 KB unchanged) to 16-byte stores along a row, not stored from the accumulator's layout (2 columns a store: half
# a 32-byte sector in bf16): B64/1k 1.12x, B256/1k 1.09x, the other cells 0.996-1.03x.


@gluon.jit
def _mla_decode_gluon_kernel(
    # pointers and TMA descriptors (None in the cp.async form)
    q_ptr, kv_ptr, req_to_token_ptr, req_pool_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    qv_desc, qr_desc, kv_desc, kr_desc,
    # sizes
    H, num_kv_splits, split_align, qk_scale,
    # strides
    stride_qb, stride_qh, stride_kvs, stride_rtr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    # constexpr
    KV_LORA: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    GATHER_V: gl.constexpr, GATHER_R: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
    QV_SMEM: gl.constexpr, QR_SMEM: gl.constexpr, KV_SMEM: gl.constexpr, KR_SMEM: gl.constexpr,
    P_SMEM: gl.constexpr, TMA: gl.constexpr, MAX_XCHG: gl.constexpr, GATHER_UNDER_S: gl.constexpr, PDL: gl.constexpr,
    CLUSTER: gl.constexpr, MERGE_LAYOUT: gl.constexpr, COALESCED_OUT: gl.constexpr, OUT_LAYOUT: gl.constexpr,
):  # fmt: skip
    if CLUSTER > 1:  # the splits of one (head block, request) are one cluster, merged in it (cluster_merge.py)
        hb = gl.program_id(0) // CLUSTER
        split = gl.program_id(0) % CLUSTER
    else:
        hb = gl.program_id(0)  # fastest axis: both head blocks of a (request, split) read each tile, via L2
        split = gl.program_id(2)
    b = gl.program_id(1)
    start, end, seq_len, r2t = split_bounds(seq_lens_ptr, req_pool_ptr, req_to_token_ptr, stride_rtr, b, split,
                                            num_kv_splits, split_align)  # fmt: skip
    if TMA:  # tiles 0 and 1's cache rows, 0 past end (the refill of tile 1 then waits on no load)
        slot_0 = first_slot(r2t, start, end)
        slot_n = first_slot(r2t, start + BLOCK_N, end)
    if PDL:  # a programmatic dependent: the index tables above are read before the wait, q and the cache after it
        grid_dependency_wait()
        launch_dependents()
    if start < end:  # else: more splits than this request needs; stage 2 skips the split too
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        qv_s = gl.allocate_shared_memory(dtype, [BLOCK_H, KV_LORA], QV_SMEM)
        qr_s = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], QR_SMEM)
        kv_a = gl.allocate_shared_memory(dtype, [BLOCK_N, KV_LORA], KV_SMEM)  # even tiles
        kr_a = gl.allocate_shared_memory(dtype, [BLOCK_N, ROPE], KR_SMEM)
        kv_b = gl.allocate_shared_memory(dtype, [BLOCK_N, KV_LORA], KV_SMEM)  # odd tiles
        kr_b = gl.allocate_shared_memory(dtype, [BLOCK_N, ROPE], KR_SMEM)
        p_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], P_SMEM)
        mx_s = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        # the row sums kept element-wise, [64 heads, 64 keys] (16 registers a thread), summed over keys once
        # after the loop: gl.sum over the keys each tile crossed the two warpgroups (each holds 32 keys of a
        # row) through shared memory and a barrier, one of the two cross-warpgroup reductions a tile
        l_e = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
        acc = gl.zeros([BLOCK_H, KV_LORA], gl.float32, layout=O_LAYOUT)
        s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_LAYOUT)
        keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        num_tiles = gl.cdiv(end - start, BLOCK_N)
        if TMA:
            bv_a, br_a, bv_b, br_b = stage_barriers()  # see wide_tile.tile_tma for why four allocations
            # q [64 heads, C] as rows b H + 64 hb of q viewed [B H, C], beside tile 0: one latency
            tma_first_tile(qv_desc, qr_desc, kv_desc, kr_desc, qv_s, qr_s, kv_a, kr_a, bv_a, br_a, b * H + hb * BLOCK_H,
                           slot_0, False, False, KV_LORA)  # fmt: skip
            for t in range(0, num_tiles, 2):
                slot_n, m_i, l_e, acc = tile_tma(
                    t, start, end, num_tiles, qk_scale, qv_s, qr_s, mx_s, kv_a, kr_a, bv_a, br_a, kv_b, kr_b, bv_b,
                    br_b, p_s, kv_desc, kr_desc, r2t, slot_n, keys, s_zero, m_i, l_e, acc,
                    KV_LORA, BLOCK_N, O_LAYOUT, MAX_XCHG)  # fmt: skip
                if t + 1 < num_tiles:
                    slot_n, m_i, l_e, acc = tile_tma(
                        t + 1, start, end, num_tiles, qk_scale, qv_s, qr_s, mx_s, kv_b, kr_b, bv_b, br_b, kv_a, kr_a,
                        bv_a, br_a, p_s, kv_desc, kr_desc, r2t, slot_n, keys, s_zero, m_i, l_e, acc,
                        KV_LORA, BLOCK_N, O_LAYOUT, MAX_XCHG)  # fmt: skip
        else:
            # q [64, kv_lora + rope] by cp.async in the same group as tile 0's gather: the two latencies overlap (a
            # register load then a store put q's ~1 us ahead of the first gather: part of the ~4 tiles of fixed
            # cost per program, tile.GLUON_FIXED_TILES)
            rows_v, rows_r, cols_v, cols_r = gather_first_tile(
                q_ptr, kv_ptr, r2t, qv_s, qr_s, kv_a, kr_a, b, hb * BLOCK_H, H, start, end, stride_qb, stride_qh,
                stride_kvs, BLOCK_H, BLOCK_N, KV_LORA, ROPE, GATHER_V, GATHER_R)  # fmt: skip
            # tile 1's slots, one iteration early: the gather issued in an iteration then waits on no load of
            # its own (the Triton kernel's EARLY_SLOTS, for the same reason)
            sl_v, sl_r, m_v, m_r = row_slots(r2t, start + BLOCK_N, rows_v, rows_r, end, gl.int64)
            for t in range(0, num_tiles, 2):
                sl_v, sl_r, m_v, m_r, m_i, l_e, acc = tile_gather(
                    t, start, end, qk_scale, qv_s, qr_s, mx_s, kv_a, kr_a, kv_b, kr_b, p_s, kv_ptr, r2t, stride_kvs,
                    sl_v, sl_r, m_v, m_r, rows_v, rows_r, cols_v, cols_r, keys, s_zero, m_i, l_e, acc,
                    BLOCK_N, O_LAYOUT, MAX_XCHG, GATHER_UNDER_S)  # fmt: skip
                if t + 1 < num_tiles:
                    sl_v, sl_r, m_v, m_r, m_i, l_e, acc = tile_gather(
                        t + 1, start, end, qk_scale, qv_s, qr_s, mx_s, kv_b, kr_b, kv_a, kr_a, p_s, kv_ptr, r2t,
                        stride_kvs, sl_v, sl_r, m_v, m_r, rows_v, rows_r, cols_v, cols_r, keys, s_zero, m_i, l_e,
                        acc, BLOCK_N, O_LAYOUT, MAX_XCHG, GATHER_UNDER_S)  # fmt: skip
            async_copy.wait_group(0)

        l_i = gl.sum(l_e, axis=1)
        if CLUSTER > 1:  # part_out is the output; the cluster's ranks each merge and store kv_lora / CLUSTER columns
            cluster_merge_store(acc, m_i, l_i, part_out_ptr, b, hb * BLOCK_H, H, stride_pb, stride_ph,
                                KV_LORA, BLOCK_H, CLUSTER, True, MERGE_LAYOUT)  # fmt: skip
        else:
            out = (acc / gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))[:, None]).to(part_out_ptr.dtype.element_ty)
            if COALESCED_OUT:  # through shared memory (the tile buffers are dead now) to 16-byte stores along a row
                out = gl.convert_layout(out, OUT_LAYOUT)
                h_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, OUT_LAYOUT))
                c_o = gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, OUT_LAYOUT))
            else:  # from the accumulator's layout: pairs of columns a thread, half a sector a store in bf16
                h_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_LAYOUT))
                c_o = gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, O_LAYOUT))
            part = part_out_ptr + b * stride_pb + h_o[:, None] * stride_ph + split * stride_ps + c_o[None, :]
            gl.store(part, out, mask=(h_o < H)[:, None])  # one split: part_out is the output itself
            h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_LAYOUT))
            gl.store(part_lse_ptr + b * stride_lb + h_s * stride_lh + split, m_i + gl.log2(l_i), mask=h_s < H)
    elif CLUSTER > 1:  # no keys for this split: it still takes part in the cluster's barriers, weighing nothing
        cluster_merge_nothing(part_out_ptr, b, hb * BLOCK_H, H, stride_pb, stride_ph, KV_LORA, BLOCK_H, CLUSTER, True,
                              O_LAYOUT, gl.SliceLayout(1, S_LAYOUT), MERGE_LAYOUT)  # fmt: skip


def _layouts(kv_lora: int, rope: int, dtype: Any, out_bytes: int = 4) -> dict[str, Any]:
    nvmma = gl.NVMMASharedLayout.get_default_for
    vec = 16 // out_bytes  # 16-byte stores: 4 fp32 partials, 8 bf16 outputs
    return {
        "OUT_LAYOUT": gl.BlockedLayout([1, vec], [1, 32], [NUM_WARPS, 1], [1, 0]),  # a warp: 32 x 16 B of one row
        "GATHER_V": gather_layout(kv_lora, NUM_WARPS),
        "GATHER_R": gather_layout(rope, NUM_WARPS),
        "S_LAYOUT": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]),
        "O_LAYOUT": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, kv_lora // 2, 16]),
        "QV_SMEM": nvmma([BLOCK_H, kv_lora], dtype),
        "QR_SMEM": nvmma([BLOCK_H, rope], dtype),
        "KV_SMEM": nvmma([BLOCK_N, kv_lora], dtype),
        "KR_SMEM": nvmma([BLOCK_N, rope], dtype),
        "P_SMEM": nvmma([BLOCK_H, BLOCK_N], dtype),
    }  # fmt: skip


def mla_decode_stage1_wide(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    kv_lora_rank: int,
    qk_scale: float,
    tile: DecodeTile,
    pdl: bool = False,
    cluster: int = 1,
) -> bool:
    """Fills part_out [B, H, P, kv_lora] fp32 and part_lse [B, H, P] (log2 units) as the Triton stage 1 (P = 1:
    part_out may be the output [B, H, 1, kv_lora] in q's dtype, which then needs no merge). tile.page_size: the
    caller's guarantee on req_to_token (slots in runs of page_size, each run starting at a multiple of it); a multiple
    of 64 picks the TMA form (tma_usable), else cp.async row copies. tile.max_xchg / gather_under_s / coalesced_out:
    the schedule switches. pdl: launched as a programmatic dependent (sm_90; DecodeTile.pdl).
    cluster = P in CLUSTER_SIZES: the P splits of a (head block, request) run as one cluster and merge in it
    (cluster_merge.py): part_out is then the output [B, H, 1, kv_lora] and part_lse is not written. False: the
    clusters would not all fit on the GPU at once, nothing launched (the caller takes the merge kernel)."""
    B, H, C = q.shape
    num_kv_splits = cluster if cluster > 1 else part_out.shape[2]
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    n_hb = (H + BLOCK_H - 1) // BLOCK_H
    layouts = _layouts(kv_lora_rank, C - kv_lora_rank, gdt, part_out.element_size())
    tma = tma_usable(q, kv_cache, tile.page_size)
    descs: tuple[TensorDescriptor | None, ...] = (None,) * 4
    if tma:
        descs = tile_descriptors(q, kv_cache, kv_lora_rank, BLOCK_H, BLOCK_N, layouts)
    args = (
        q, kv_cache, req_to_token, req_pool_indices, seq_lens, part_out, part_lse, *descs,
        H, num_kv_splits, tile.block_n, qk_scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), req_to_token.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
    )  # fmt: skip
    merge = merge_layout(kv_lora_rank, cluster, NUM_WARPS) if cluster > 1 else None
    kwargs = dict(KV_LORA=kv_lora_rank, ROPE=C - kv_lora_rank, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, **layouts,
                  MAX_XCHG=tile.max_xchg, GATHER_UNDER_S=tile.gather_under_s, COALESCED_OUT=tile.coalesced_out,
                  TMA=tma, PDL=pdl, CLUSTER=cluster, MERGE_LAYOUT=merge, num_warps=NUM_WARPS,
                  launch_pdl=pdl)  # fmt: skip
    if cluster > 1:
        return launch_in_clusters(_mla_decode_gluon_kernel, (n_hb, B, 1), cluster, args, kwargs,
                                  exchange_bytes(kv_lora_rank, BLOCK_H, cluster))  # fmt: skip
    _mla_decode_gluon_kernel[(n_hb, B, num_kv_splits)](*args, **kwargs)
    return True


def _supported(shape: DecodeShape, dtype: torch.dtype, page_size: int) -> str | None:
    """bf16 / fp16 and a latent shape the layouts take; any page size (cp.async rows below 64-slot pages)."""
    return gluon_shape_error(shape, dtype, "wide")


STAGE1 = Stage1("wide", hopper=True, fixed_tile=(BLOCK_H, BLOCK_N, NUM_WARPS), supported=_supported,
                launch=mla_decode_stage1_wide)  # fmt: skip
