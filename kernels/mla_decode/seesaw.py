"""MLA decode stage 1 in Gluon for H >= 64 on Hopper ("seesaw" record and schedule): the two warpgroups take
alternate 64-key tiles, each computing its tile's scores whole, and pass the row max and P between them.

Shape legend as in decode.py. One program = (64-head block, request, split): two warp-specialized warpgroups
(gl.warp_specialize), WG0 the default partition, WG1 a worker, each holding one half of O [64, kv_lora / 2] in
registers (the whole O, 128 KB of fp32, does not fit one warpgroup's registers). A split's tiles go in pairs (t0 =
2i in buffer K0, t1 = 2i + 1 in K1); with m the running row max and Ol / Or the halves of O (V = a tile's c_kv):

    WG0: S0 = q K0^T (N = 64) -> m0 = max(m, rowmax S0), a0 = exp2(m - m0)      --m0, a0-->  WG1
         P0 = exp2(S0 - m0); Ol = Ol a0 + P0 V0[:, :half]              (P0 from registers)
    WG1: S1 = q K1^T (N = 64) -> m1 = max(m0, rowmax S1), a1 = exp2(m0 - m1)    --m1, a1-->  WG0
         P1 = exp2(S1 - m1) -> K0's rope rows (dead once S0 is done)            --P1------>  WG0
         Or = Or a0 a1 + P1 V1[:, half:]                               (P1 from registers)
    WG0: P0 a1 -> its own buffer                                                --P0 a1--->  WG1
         Ol = Ol a1 + P1 V1[:, :half]                                  (P1 from shared memory)
    WG1: Or = Or + (P0 a1) V0[:, half:]                                (P0 a1 from shared memory)

Both halves end each pair at the row max m1 (the online softmax's algebra; the schedule is FlashMLA's published
"seesaw", docs/20250422-new-kernel-deep-dive.md in deepseek-ai/FlashMLA, written here from that description). What
it buys over the wide kernel (wide.py) (one tile's scores split across both warpgroups at N = 32, so both read all
of q from shared memory, then the softmax with every tensor core idle): each score wgmma is N = 64, half the q
traffic per key, and one warpgroup's softmax runs under the other's wgmmas.

With two tile buffers the loads are what limits it (refilling a whole tile after the pair's last product was
1.08-1.33x slower than the wide kernel). So each tile is six parts on six
barriers, c_kv's left and right halves and the rope rows of K0 and K1, each refilled by its last reader as soon as
it is done with it (K0: left by WG0 after P0 V0, right by WG1 after its P0 V0, rope by WG0 after its P1 V1, whose P1
lived there; K1: rope by WG1 right after S1, right by WG1 after P1 V1, left by WG0 after its P1 V1), and each
warpgroup's scores take the parts in that order, every product issued as its part lands. Shared memory: q 72 KB, K0
and K1 72 KB each, P0 8 KB, 226 KB in all. Each row sum is kept by the warpgroup whose P it sums and added once at
the end; the output goes through a dead tile buffer to 16-byte stores.

When it runs: the default at H >= 64 on Hopper on pages of a multiple of 64 slots at rope 64 (package docstring),
at the wide kernel's split counts: 1.08-1.10x the wide kernel at kv_len >= 8k, 1.03-1.05x at B64/1k and B256/1k,
0.965x at B16/1k (H200; BENCHMARKS.md#mla-decode). Limits: TMA form only (pages of a multiple of 64 slots), rope 64
(P1 lives in a tile's [64, rope] rows), no PDL, no clusters. Gluon does not run under TRITON_INTERPRET=1: gpu-marked
tests only.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from r3trace.kernels.contract import require
from r3trace.kernels.mla_decode.latent_tiles import split_bounds, tile_descriptors, tma_usable
from r3trace.kernels.mla_decode.registry import TMA_PAGE, DecodeShape, Stage1, gluon_shape_error
from r3trace.kernels.mla_decode.seesaw_tile import bar, load_part, masked_scores, rows, scores, signal, store_half
from r3trace.kernels.mla_decode.tile import DecodeTile

__all__ = ["STAGE1", "mla_decode_stage1_seesaw"]

BLOCK_H = 64  # one wgmma M
BLOCK_N = 64  # keys a tile; each warpgroup's scores one wgmma of N = 64
NUM_WARPS = 8  # two warpgroups: the default partition and one worker of 4 warps each
WG_REGS = gl.constexpr(232)  # the worker's registers a thread (setmaxnreg; a multiple of 8): O's half alone is 128


@gluon.jit
def _wg0(
    bufs, bars, src, dst, KV_LORA: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, P_OPND: gl.constexpr,
):  # fmt: skip
    """Even tiles' scores; the left half of O; refills K0's left columns and rope rows and K1's left columns. The
    arguments (both partitions take the same): the shared buffers, the barriers, where tiles come from (descriptors,
    the request's req_to_token row, its split's bounds, the scale) and where the output goes."""
    HALF: gl.constexpr = KV_LORA // 2
    qv_s, qr_s, kv0, kr0, kv1, kr1, p0_s, xch, lx = bufs
    kvh_desc, kr_desc, r2t, start, end, num_tiles, qk_scale = src
    part_out_ptr, part_lse_ptr, b, hb, H, split, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh = dst
    bq, b0r, b0a, b0b, b1r, b1a, b1b, sc0_bar, sc1_bar, p0_bar, p1_bar, l0_bar, l1_bar = bars
    row: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=O_LAYOUT)
    mbarrier.wait(bq, 0, pred=num_tiles > 0)
    for i in range(gl.cdiv(num_tiles, 2)):
        ph = i & 1
        n_next = start + (2 * i + 2) * BLOCK_N  # this warpgroup's next tile (< end: there is one)
        s = scores(qv_s, qr_s, kv0, kr0, b0a, b0b, b0r, ph, True, 1, 2, 0, S_LAYOUT, KV_LORA)
        s = masked_scores(s, 2 * i, start, end, qk_scale, BLOCK_N, S_LAYOUT)
        m0 = gl.maximum(m_i, gl.max(s, axis=1))
        a0 = gl.exp2(m_i - m0)
        xch.slice(0, BLOCK_H).store(m0)
        xch.slice(BLOCK_H, BLOCK_H).store(a0)
        signal(sc0_bar)
        p = gl.exp2(s - m0[:, None])
        pb = p.to(kv0.dtype)
        l_i = l_i * a0 + gl.sum(p, axis=1)
        p_op = gl.convert_layout(pb, P_OPND)
        acc = warpgroup_mma(p_op, kv0.slice(0, HALF, dim=1), acc * rows(a0, O_LAYOUT), is_async=True)
        mbarrier.wait(sc1_bar, ph)
        m_i = xch.slice(2 * BLOCK_H, BLOCK_H).load(row)
        a1 = xch.slice(3 * BLOCK_H, BLOCK_H).load(row)
        p0_s.store((pb.to(gl.float32) * a1[:, None]).to(kv0.dtype))  # P0 at m1, for WG1's P0 V0 (after its P1 V1)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        signal(p0_bar)
        if n_next < end:  # K0's left columns are read by this warpgroup alone, and it is done with them
            load_part(kvh_desc, kr_desc, b0a, kv0, kr0, r2t, n_next, end, 0, True, False, KV_LORA)
        l_i = l_i * a1
        acc = acc * rows(a1, O_LAYOUT)
        if 2 * i + 1 < num_tiles:
            mbarrier.wait(p1_bar, ph)
            acc = warpgroup_mma(kr0, kv1.slice(0, HALF, dim=1), acc, is_async=True)  # P1 from K0's rope rows
            acc = warpgroup_mma_wait(0, deps=(acc,))
            gl.thread_barrier()
            if 2 * i + 3 < num_tiles:  # K1's left columns: this warpgroup was their last reader
                load_part(kvh_desc, kr_desc, b1b, kv1, kr1, r2t, n_next + BLOCK_N, end, 0, True, False, KV_LORA)
        if n_next < end:  # K0's rope rows, read by S0 and then (holding P1) by the product just done
            load_part(kvh_desc, kr_desc, b0r, kv0, kr0, r2t, n_next, end, 0, False, True, KV_LORA)
    if num_tiles > 0:
        lx.slice(0, BLOCK_H).store(l_i)
        signal(l0_bar)
        mbarrier.wait(l1_bar, 0)
        l_sum = l_i + lx.slice(BLOCK_H, BLOCK_H).load(row)
        # l1 arrived: both warpgroups are past their loops, every tile buffer is dead
        store_half(acc, l_sum, kv0, part_out_ptr, b, hb, H, split, stride_pb, stride_ph, stride_ps, 0, HALF,
                    BLOCK_H, O_LAYOUT)  # fmt: skip
        h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row)
        gl.store(part_lse_ptr + b * stride_lb + h_s * stride_lh + split, m_i + gl.log2(l_sum), mask=h_s < H)


@gluon.jit
def _wg1(
    bufs, bars, src, dst, KV_LORA: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, P_OPND: gl.constexpr,
):  # fmt: skip
    """Odd tiles' scores; the right half of O; refills K1's rope rows and right columns and K0's right columns."""
    HALF: gl.constexpr = KV_LORA // 2
    qv_s, qr_s, kv0, kr0, kv1, kr1, p0_s, xch, lx = bufs
    kvh_desc, kr_desc, r2t, start, end, num_tiles, qk_scale = src
    part_out_ptr, part_lse_ptr, b, hb, H, split, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh = dst
    bq, b0r, b0a, b0b, b1r, b1a, b1b, sc0_bar, sc1_bar, p0_bar, p1_bar, l0_bar, l1_bar = bars
    row: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row)
    m1 = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, layout=O_LAYOUT)
    mbarrier.wait(bq, 0, pred=num_tiles > 0)
    for i in range(gl.cdiv(num_tiles, 2)):
        ph = i & 1
        has1 = 2 * i + 1 < num_tiles
        n_next = start + (2 * i + 3) * BLOCK_N  # this warpgroup's next tile (< end: there is one)
        # without tile t1 (a split's odd last tile) K1 holds stale or never-written rows: every score is masked
        s = scores(qv_s, qr_s, kv1, kr1, b1r, b1a, b1b, ph, has1, 0, 2, 1, S_LAYOUT, KV_LORA)
        if n_next < end:  # K1's rope rows are read by S1 alone: refilled at once
            gl.thread_barrier()
            load_part(kvh_desc, kr_desc, b1r, kv1, kr1, r2t, n_next, end, 0, False, True, KV_LORA)
        s = masked_scores(s, 2 * i + 1, start, end, qk_scale, BLOCK_N, S_LAYOUT)
        mbarrier.wait(sc0_bar, ph)
        m0 = xch.slice(0, BLOCK_H).load(row)
        a0 = xch.slice(BLOCK_H, BLOCK_H).load(row)
        m1 = gl.maximum(m0, gl.max(s, axis=1))
        a1 = gl.exp2(m0 - m1)
        xch.slice(2 * BLOCK_H, BLOCK_H).store(m1)
        xch.slice(3 * BLOCK_H, BLOCK_H).store(a1)
        signal(sc1_bar)
        p = gl.exp2(s - m1[:, None])
        l_i = l_i * (a0 * a1) + gl.sum(p, axis=1)
        acc = acc * rows(a0 * a1, O_LAYOUT)
        if has1:
            pb = p.to(kv1.dtype)
            kr0.store(pb)  # K0's rope rows are dead once S0 is waited (sc0 says so): P1 for WG0
            signal(p1_bar)
            p_op = gl.convert_layout(pb, P_OPND)
            acc = warpgroup_mma(p_op, kv1.slice(HALF, HALF, dim=1), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            if n_next < end:  # K1's right columns: read by this warpgroup alone
                gl.thread_barrier()
                load_part(kvh_desc, kr_desc, b1a, kv1, kr1, r2t, n_next, end, HALF, True, False, KV_LORA)
        mbarrier.wait(p0_bar, ph)
        acc = warpgroup_mma(p0_s, kv0.slice(HALF, HALF, dim=1), acc, is_async=True)  # P0 at m1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if 2 * i + 2 < num_tiles:  # K0's right columns: this warpgroup was their last reader
            gl.thread_barrier()
            load_part(kvh_desc, kr_desc, b0b, kv0, kr0, r2t, start + (2 * i + 2) * BLOCK_N, end, HALF, True, False,
                       KV_LORA)  # fmt: skip
    if num_tiles > 0:
        lx.slice(BLOCK_H, BLOCK_H).store(l_i)
        signal(l1_bar)
        mbarrier.wait(l0_bar, 0)
        l_sum = l_i + lx.slice(0, BLOCK_H).load(row)
        store_half(acc, l_sum, kv1, part_out_ptr, b, hb, H, split, stride_pb, stride_ph, stride_ps, HALF, HALF,
                    BLOCK_H, O_LAYOUT)  # fmt: skip


@gluon.jit
def _mla_decode_seesaw_kernel(
    req_to_token_ptr, req_pool_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, qv_desc, qr_desc, kvh_desc, kr_desc,
    H, num_kv_splits, split_align, qk_scale,
    stride_rtr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    KV_LORA: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, P_OPND: gl.constexpr,
    QV_SMEM: gl.constexpr, QR_SMEM: gl.constexpr, KV_SMEM: gl.constexpr, KR_SMEM: gl.constexpr,
):  # fmt: skip
    HALF: gl.constexpr = KV_LORA // 2
    hb = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    start, end, seq_len, r2t = split_bounds(seq_lens_ptr, req_pool_ptr, req_to_token_ptr, stride_rtr, b, split,
                                            num_kv_splits, split_align)  # fmt: skip
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)  # 0: more splits than this request needs
    dtype: gl.constexpr = kvh_desc.dtype
    qv_s = gl.allocate_shared_memory(dtype, [BLOCK_H, KV_LORA], QV_SMEM)
    qr_s = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], QR_SMEM)
    kv0 = gl.allocate_shared_memory(dtype, [BLOCK_N, KV_LORA], KV_SMEM)
    kr0 = gl.allocate_shared_memory(dtype, [BLOCK_N, ROPE], KR_SMEM)
    kv1 = gl.allocate_shared_memory(dtype, [BLOCK_N, KV_LORA], KV_SMEM)
    kr1 = gl.allocate_shared_memory(dtype, [BLOCK_N, ROPE], KR_SMEM)
    p0_s = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], KR_SMEM)  # P0 for WG1 (P1 lives in K0's rope rows)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    xch = gl.allocate_shared_memory(gl.float32, [4 * BLOCK_H], flat)  # m0, a0 (WG0's), m1, a1 (WG1's)
    lx = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], flat)  # the two row sums at the end
    # q; K0's rope rows, left and right columns; K1's the same: each part on its own barrier, refilled by its last
    # reader as soon as it is done with it; then the exchanges
    bars = (bar(), bar(), bar(), bar(), bar(), bar(), bar(), bar(), bar(), bar(), bar(), bar(), bar())
    fence_async_shared()  # the inits visible to the TMA unit before it signals them
    bq, b0r, b0a, b0b, b1r, b1a, b1b = bars[0], bars[1], bars[2], bars[3], bars[4], bars[5], bars[6]
    if num_tiles > 0:  # q and tiles 0 and 1
        mbarrier.expect(bq, qv_desc.block_type.nbytes + qr_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(qv_desc, [b * H + hb * BLOCK_H, 0], bq, qv_s)
        tma.async_copy_global_to_shared(qr_desc, [b * H + hb * BLOCK_H, KV_LORA], bq, qr_s)
        load_part(kvh_desc, kr_desc, b0a, kv0, kr0, r2t, start, end, 0, True, False, KV_LORA)
        load_part(kvh_desc, kr_desc, b0b, kv0, kr0, r2t, start, end, HALF, True, False, KV_LORA)
        load_part(kvh_desc, kr_desc, b0r, kv0, kr0, r2t, start, end, 0, False, True, KV_LORA)
        if num_tiles > 1:
            load_part(kvh_desc, kr_desc, b1r, kv1, kr1, r2t, start + BLOCK_N, end, 0, False, True, KV_LORA)
            load_part(kvh_desc, kr_desc, b1a, kv1, kr1, r2t, start + BLOCK_N, end, HALF, True, False, KV_LORA)
            load_part(kvh_desc, kr_desc, b1b, kv1, kr1, r2t, start + BLOCK_N, end, 0, True, False, KV_LORA)
    bufs = (qv_s, qr_s, kv0, kr0, kv1, kr1, p0_s, xch, lx)
    src = (kvh_desc, kr_desc, r2t, start, end, num_tiles, qk_scale)
    dst = (part_out_ptr, part_lse_ptr, b, hb, H, split, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh)
    # the layouts stay constexprs only written inside the call (a tuple bound to a name turns them into tensors)
    gl.warp_specialize([
        (_wg0, (bufs, bars, src, dst, KV_LORA, BLOCK_H, BLOCK_N, S_LAYOUT, O_LAYOUT, P_OPND)),
        (_wg1, (bufs, bars, src, dst, KV_LORA, BLOCK_H, BLOCK_N, S_LAYOUT, O_LAYOUT, P_OPND)),
    ], [4], [WG_REGS])  # fmt: skip


def _layouts(kv_lora: int, rope: int, dtype: Any) -> dict[str, Any]:
    nvmma = gl.NVMMASharedLayout.get_default_for
    o_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, kv_lora // 2, 16])
    return {
        "S_LAYOUT": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]),
        "O_LAYOUT": o_layout,
        "P_OPND": gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2),
        "QV_SMEM": nvmma([BLOCK_H, kv_lora], dtype),
        "QR_SMEM": nvmma([BLOCK_H, rope], dtype),
        "KV_SMEM": nvmma([BLOCK_N, kv_lora], dtype),
        "KR_SMEM": nvmma([BLOCK_N, rope], dtype),  # also P [64 heads, 64 keys]: the same shape at rope 64
    }  # fmt: skip


def mla_decode_stage1_seesaw(
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
    """Fills part_out [B, H, P, kv_lora] fp32 and part_lse [B, H, P] (log2 units) as the wide kernel's stage 1 (P
    = 1: part_out may be the output in q's dtype). Needs its TMA form's conditions (latent_tiles.tma_usable: pages
    of a multiple of 64 slots); no PDL, no clusters (False: nothing launched, the caller takes the merge kernel)."""
    if cluster > 1:
        return False
    require(not pdl, "the seesaw decode kernel has no programmatic dependent launch (DecodeTile.pdl)")
    require(tma_usable(q, kv_cache, tile.page_size), f"the seesaw decode kernel loads tiles by TMA: page_size "
            f"{tile.page_size} must be a multiple of {BLOCK_N}, q contiguous, rows 16-byte aligned")  # fmt: skip
    B, H, C = q.shape
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    layouts = _layouts(kv_lora_rank, C - kv_lora_rank, gdt)
    qv, qr, _, kr = tile_descriptors(q, kv_cache, kv_lora_rank, BLOCK_H, BLOCK_N, layouts)
    # half a tile's c_kv columns a box: each half has its own last reader (the module doc)
    half = kv_lora_rank // 2
    kvh = TensorDescriptor(kv_cache, list(kv_cache.shape), [kv_cache.stride(0), 1], [BLOCK_N, half],
                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, half], gdt))  # fmt: skip
    descs = (qv, qr, kvh, kr)
    grid = ((H + BLOCK_H - 1) // BLOCK_H, B, part_out.shape[2])
    _mla_decode_seesaw_kernel[grid](
        req_to_token, req_pool_indices, seq_lens, part_out, part_lse, *descs,
        H, part_out.shape[2], tile.block_n, qk_scale,
        req_to_token.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        KV_LORA=kv_lora_rank, ROPE=C - kv_lora_rank, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, **layouts, num_warps=4,
    )  # fmt: skip
    return True


def _supported(shape: DecodeShape, dtype: torch.dtype, page_size: int) -> str | None:
    """As the wide kernel, and rope 64 (P lives in a tile's [64, rope] rows) on pages of a multiple of 64 slots
    (TMA tiles only)."""
    why = gluon_shape_error(shape, dtype, "seesaw")
    if why is None and shape.rope != BLOCK_N:
        return f"the seesaw decode kernel keeps P in a tile's rope rows: rope must be {BLOCK_N}, got {shape.rope}"
    if why is None and page_size % TMA_PAGE:
        return f"the seesaw decode kernel loads tiles by TMA: page_size {page_size} must be a multiple of {TMA_PAGE}"
    return why


STAGE1 = Stage1("seesaw", hopper=True, fixed_tile=(BLOCK_H, BLOCK_N, NUM_WARPS), supported=_supported,
                launch=mla_decode_stage1_seesaw)  # fmt: skip
