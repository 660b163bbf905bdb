"""MLA decode stage 1 in Gluon for few heads (H = 16, DeepSeek-V3 under TP8) on Hopper ("narrow" record): keys-major
wgmma. The default at H < 64 on Hopper on pages of a multiple of 64 slots (package docstring).

Shape legend as in decode.py: B requests, H heads, C = kv_lora + rope, P = num_kv_splits; one program = (16-head
block, request, split), one warpgroup (4 warps). Per 64-key tile (narrow_tile.py), everything transposed so that the 64
keys are the wgmma's M and the 16 heads its N: S^T = c_kv q^T, P^T through shared memory, O^T += c_kv^T P^T.

Why: the Triton tile (16 heads x 32 keys, mma.sync, two programs an SM) spends ~706 instructions a warp and 9 barriers
a 32-key tile and issues 0.33 instructions a cycle, latency-bound at 12.5% occupancy: at 19-151 MB it reaches 34-74% of
copy bandwidth. Here a 64-key tile is 36 + 32 wgmma instructions with both operands in shared memory, the tile arrives
as TMA boxes on an mbarrier where the pages allow (no per-thread gather), and the softmax needs 2 barriers (the column
max exchanged between the 4 warps, each holding 16 keys; P^T written), plus one before the refill. The head dimension
N = 16 costs nothing extra (no padding of 16 heads to 64 rows).

Shared memory: q 18 KB, two stages of the tile (c_kv [64, 512] + k_pe [64, 64]) 144 KB, P^T 2 KB: one program an SM, 72
KB in flight per SM while it computes the other stage. The O^T accumulator is 64 fp32 registers a thread. The next tile
is loaded one tile ahead in one of two forms, as in the wide kernel (wide.py), picked by the launcher from the tile's
page size: TMA boxes on mbarriers (pages of a multiple of 64 slots: a tile's keys are 64 consecutive cache rows) or
cp.async row copies through req_to_token (any page size). Writes the same partials and LSEs as the Triton stage 1 (the
merge is shared). With DecodeTile.pdl it is launched as a programmatic dependent and waits (griddepcontrol.wait) before
it reads q or the cache (3-8% faster at B16/1k, B16/8k, B64/1k); the index tables and the first two tiles' cache rows
are read before the wait, and in the TMA form so is tile 0 unless it holds the request's last position (B64/1k 1.05x
more). Against the Triton tile on 64-slot pages: 1.10-1.18x at all nine cells, 82% of copy bandwidth at B16/8k, 93-108%
at the >= 300 MB cells; the cp.async form only ties the Triton tile, so the default takes this kernel on 64-slot pages
only. A merge by the last split program of each (request, head block) through global memory was 1.05-1.8x slower than
the merge kernel; the splits merged inside a thread-block cluster (cluster_merge.py, the default at 2 splits) are
1.07-1.09x faster at B64/1k. Figures: H200, BENCHMARKS.md#mla-decode. Not under TRITON_INTERPRET (Gluon); covered by
gpu-marked tests. Requires sm_90, bf16/fp16, kv_lora in {128, 256, 512}, rope a power of two in 16..128."""

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
from r3trace.kernels.mla_decode.narrow_tile import tile_gather, tile_tma
from r3trace.kernels.mla_decode.registry import DecodeShape, Stage1, gluon_shape_error
from r3trace.kernels.mla_decode.tile import DecodeTile

BLOCK_H = 16  # the wgmma's N: 16 heads, no padding
BLOCK_N = 64  # keys a tile: the wgmma's M, 16 per warp
NUM_WARPS = 4  # one warpgroup


@gluon.jit
def _mla_decode_narrow_kernel(
    # pointers and TMA descriptors (None in the cp.async form)
    q_ptr, kv_ptr, req_to_token_ptr, req_pool_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    qv_desc, qr_desc, kv_desc, kr_desc,
    # sizes
    H, num_kv_splits, split_align, qk_scale,
    # strides
    stride_qb, stride_qh, stride_kvs, stride_rtr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    # constexpr
    KV_LORA: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, OUT_LAYOUT: gl.constexpr, GATHER_V: gl.constexpr,
    GATHER_R: gl.constexpr, QV_SMEM: gl.constexpr, QR_SMEM: gl.constexpr, KV_SMEM: gl.constexpr,
    KR_SMEM: gl.constexpr, P_SMEM: gl.constexpr, TMA: gl.constexpr, PDL: gl.constexpr, CLUSTER: gl.constexpr,
    MERGE_LAYOUT: gl.constexpr,
):  # fmt: skip
    if CLUSTER > 1:  # the splits of one (head block, request) are one cluster, merged in it (cluster_merge.py)
        hb = gl.program_id(0) // CLUSTER
        split = gl.program_id(0) % CLUSTER
    else:
        hb = gl.program_id(0)
        split = gl.program_id(2)
    b = gl.program_id(1)
    start, end, seq_len, r2t = split_bounds(seq_lens_ptr, req_pool_ptr, req_to_token_ptr, stride_rtr, b, split,
                                            num_kv_splits, split_align)  # fmt: skip
    if TMA:  # tiles 0 and 1's cache rows, 0 past end (the refill of tile 1 then waits on no load)
        slot_0 = first_slot(r2t, start, end)
        slot_n = first_slot(r2t, start + BLOCK_N, end)
    if PDL and not TMA:  # a programmatic dependent: the index tables above read before the wait, q and the cache after
        grid_dependency_wait()  # (the TMA form waits in tma_first_tile, after issuing an early tile 0)
        launch_dependents()
    if start < end:  # else: more splits than this request needs; stage 2 skips the split too
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        qv_s = gl.allocate_shared_memory(dtype, [BLOCK_H, KV_LORA], QV_SMEM)
        qr_s = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], QR_SMEM)
        # two stages, separate allocations (the wide kernel's reason: one [2, ...] allocation indexed by t % 2
        # makes the compiler's hazard analysis add barriers between the refill and the reads)
        kv_a = gl.allocate_shared_memory(dtype, [BLOCK_N, KV_LORA], KV_SMEM)
        kr_a = gl.allocate_shared_memory(dtype, [BLOCK_N, ROPE], KR_SMEM)
        kv_b = gl.allocate_shared_memory(dtype, [BLOCK_N, KV_LORA], KV_SMEM)
        kr_b = gl.allocate_shared_memory(dtype, [BLOCK_N, ROPE], KR_SMEM)
        p_s = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], P_SMEM)
        mx_s = gl.allocate_shared_memory(gl.float32, [4 * BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, S_LAYOUT))
        l_e = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=S_LAYOUT)
        acc = gl.zeros([KV_LORA, BLOCK_H], gl.float32, layout=O_LAYOUT)
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=S_LAYOUT)
        keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_LAYOUT))
        num_tiles = gl.cdiv(end - start, BLOCK_N)
        if TMA:
            bv_a, br_a, bv_b, br_b = stage_barriers()
            # q [16 heads, C] as rows b H + 16 hb of q viewed [B H, C], beside tile 0 on its mbarriers
            # under PDL tile 0 is loaded before the wait where it holds no position past seq_len - 2 (tma_first_tile:
            # B64/1k 1.05x, B16/1k 1.06x, B64/8k 1.012x, B16/8k 1.01x)
            tma_first_tile(qv_desc, qr_desc, kv_desc, kr_desc, qv_s, qr_s, kv_a, kr_a, bv_a, br_a, b * H + hb * BLOCK_H,
                           slot_0, start + BLOCK_N < seq_len, PDL, KV_LORA)  # fmt: skip
            for t in range(0, num_tiles, 2):
                slot_n, m_i, l_e, acc = tile_tma(
                    t, start, end, num_tiles, qk_scale, qv_s, qr_s, mx_s, p_s, kv_a, kr_a, bv_a, br_a, kv_b, kr_b,
                    bv_b, br_b, kv_desc, kr_desc, r2t, slot_n, keys, s_zero, m_i, l_e, acc,
                    KV_LORA, BLOCK_N, BLOCK_H, O_LAYOUT)  # fmt: skip
                if t + 1 < num_tiles:
                    slot_n, m_i, l_e, acc = tile_tma(
                        t + 1, start, end, num_tiles, qk_scale, qv_s, qr_s, mx_s, p_s, kv_b, kr_b, bv_b, br_b, kv_a,
                        kr_a, bv_a, br_a, kv_desc, kr_desc, r2t, slot_n, keys, s_zero, m_i, l_e, acc,
                        KV_LORA, BLOCK_N, BLOCK_H, O_LAYOUT)  # fmt: skip
        else:
            rows_v, rows_r, cols_v, cols_r = gather_first_tile(
                q_ptr, kv_ptr, r2t, qv_s, qr_s, kv_a, kr_a, b, hb * BLOCK_H, H, start, end, stride_qb, stride_qh,
                stride_kvs, BLOCK_H, BLOCK_N, KV_LORA, ROPE, GATHER_V, GATHER_R)  # fmt: skip
            # tile 1's slots, one iteration early: the gather issued in an iteration waits on no load of its own
            sl_v, sl_r, m_v, m_r = row_slots(r2t, start + BLOCK_N, rows_v, rows_r, end, gl.int32)
            for t in range(0, num_tiles, 2):
                sl_v, sl_r, m_v, m_r, m_i, l_e, acc = tile_gather(
                    t, start, end, qk_scale, qv_s, qr_s, mx_s, p_s, kv_a, kr_a, kv_b, kr_b, kv_ptr, r2t, stride_kvs,
                    sl_v, sl_r, m_v, m_r, rows_v, rows_r, cols_v, cols_r, keys, s_zero, m_i, l_e, acc,
                    BLOCK_N, BLOCK_H, O_LAYOUT)  # fmt: skip
                if t + 1 < num_tiles:
                    sl_v, sl_r, m_v, m_r, m_i, l_e, acc = tile_gather(
                        t + 1, start, end, qk_scale, qv_s, qr_s, mx_s, p_s, kv_b, kr_b, kv_a, kr_a, kv_ptr, r2t,
                        stride_kvs, sl_v, sl_r, m_v, m_r, rows_v, rows_r, cols_v, cols_r, keys, s_zero, m_i, l_e,
                        acc, BLOCK_N, BLOCK_H, O_LAYOUT)  # fmt: skip
            async_copy.wait_group(0)

        l_i = gl.sum(l_e, axis=0)  # [heads]: the one cross-warp reduction of the sums
        if CLUSTER > 1:  # part_out is the output; the cluster's ranks each merge and store kv_lora / CLUSTER columns
            cluster_merge_store(acc, m_i, l_i, part_out_ptr, b, hb * BLOCK_H, H, stride_pb, stride_ph,
                                KV_LORA, BLOCK_H, CLUSTER, False, MERGE_LAYOUT)  # fmt: skip
        else:
            out = acc / gl.convert_layout(l_i, gl.SliceLayout(0, O_LAYOUT))[None, :]  # O^T [kv_lora, heads]
            # through shared memory to a layout with the kv_lora columns fastest: 16-byte stores along a row
            out = gl.convert_layout(out.to(part_out_ptr.dtype.element_ty), OUT_LAYOUT)
            c_o = gl.arange(0, KV_LORA, layout=gl.SliceLayout(1, OUT_LAYOUT))
            h_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, OUT_LAYOUT))
            part = part_out_ptr + b * stride_pb + h_o[None, :] * stride_ph + split * stride_ps + c_o[:, None]
            gl.store(part, out, mask=(h_o < H)[None, :])  # one split: part_out is the output itself
            h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, S_LAYOUT))
            gl.store(part_lse_ptr + b * stride_lb + h_s * stride_lh + split, m_i + gl.log2(l_i), mask=h_s < H)
    elif CLUSTER > 1:  # no keys for this split: it still takes part in the cluster's barriers, weighing nothing
        if PDL and TMA:  # it stores the output (its columns): the previous kernel may still read what out reuses
            grid_dependency_wait()
            launch_dependents()
        cluster_merge_nothing(part_out_ptr, b, hb * BLOCK_H, H, stride_pb, stride_ph, KV_LORA, BLOCK_H, CLUSTER, False,
                              O_LAYOUT, gl.SliceLayout(0, S_LAYOUT), MERGE_LAYOUT)  # fmt: skip


def _layouts(kv_lora: int, rope: int, dtype: Any, out_bytes: int) -> dict[str, Any]:
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_H, 16])
    vec = 16 // out_bytes  # 16-byte stores: 4 fp32 partials, 8 bf16 outputs
    tc = min(32, kv_lora // vec)
    nvmma = gl.NVMMASharedLayout.get_default_for
    return {
        "S_LAYOUT": acc,  # S^T [64, 16]: one wgmma M block, 16 keys a warp
        "O_LAYOUT": acc,  # O^T [kv_lora, 16]: kv_lora / 64 M blocks
        "OUT_LAYOUT": gl.BlockedLayout([vec, 1], [tc, 32 // tc], [1, NUM_WARPS], [0, 1]),
        "GATHER_V": gather_layout(kv_lora, NUM_WARPS),
        "GATHER_R": gather_layout(rope, NUM_WARPS),
        "QV_SMEM": nvmma([BLOCK_H, kv_lora], dtype),
        "QR_SMEM": nvmma([BLOCK_H, rope], dtype),
        "KV_SMEM": nvmma([BLOCK_N, kv_lora], dtype),
        "KR_SMEM": nvmma([BLOCK_N, rope], dtype),
        "P_SMEM": nvmma([BLOCK_N, BLOCK_H], dtype),
    }


def mla_decode_stage1_narrow(
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
    """Fills part_out [B, H, P, kv_lora] (fp32, or the output itself at P = 1) and part_lse [B, H, P] (log2 units)
    as the Triton stage 1. tile.page_size: the caller's guarantee on req_to_token (slots in runs of page_size, each
    starting at a multiple of it); a multiple of 64 picks the TMA form (tma_usable), else cp.async row copies.
    tile.block_n (64) is the split alignment (each split whole tiles). pdl: launched as a programmatic dependent
    (sm_90), waiting before it reads q or the cache (DecodeTile.pdl: the index tables are read before the wait).
    cluster = P in CLUSTER_SIZES: the P splits of a (head block, request) run as one cluster and merge in it
    (cluster_merge.py): part_out is then the output [B, H, 1, kv_lora] and part_lse is not written. False: the
    clusters would not all fit on the GPU at once, nothing launched (the caller takes the merge kernel)."""
    B, H, C = q.shape
    rope = C - kv_lora_rank
    num_kv_splits = cluster if cluster > 1 else part_out.shape[2]
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    layouts = _layouts(kv_lora_rank, rope, gdt, part_out.element_size())
    tma = tma_usable(q, kv_cache, tile.page_size)
    descs: tuple[TensorDescriptor | None, ...] = (None,) * 4
    if tma:
        descs = tile_descriptors(q, kv_cache, kv_lora_rank, BLOCK_H, BLOCK_N, layouts)
    n_hb = (H + BLOCK_H - 1) // BLOCK_H
    args = (
        q, kv_cache, req_to_token, req_pool_indices, seq_lens, part_out, part_lse, *descs,
        H, num_kv_splits, tile.block_n, qk_scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), req_to_token.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
    )  # fmt: skip
    merge = merge_layout(kv_lora_rank, cluster, NUM_WARPS) if cluster > 1 else None
    kwargs = dict(KV_LORA=kv_lora_rank, ROPE=rope, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, **layouts, TMA=tma, PDL=pdl,
                  CLUSTER=cluster, MERGE_LAYOUT=merge, num_warps=NUM_WARPS, launch_pdl=pdl)  # fmt: skip
    if cluster > 1:
        return launch_in_clusters(_mla_decode_narrow_kernel, (n_hb, B, 1), cluster, args, kwargs,
                                  exchange_bytes(kv_lora_rank, BLOCK_H, cluster))  # fmt: skip
    _mla_decode_narrow_kernel[(n_hb, B, num_kv_splits)](*args, **kwargs)
    return True


def _supported(shape: DecodeShape, dtype: torch.dtype, page_size: int) -> str | None:
    """bf16 / fp16 and a latent shape the layouts take; any page size (cp.async rows below 64-slot pages)."""
    return gluon_shape_error(shape, dtype, "narrow Gluon")


STAGE1 = Stage1("narrow", hopper=True, fixed_tile=(BLOCK_H, BLOCK_N, NUM_WARPS), supported=_supported,
                launch=mla_decode_stage1_narrow)  # fmt: skip
