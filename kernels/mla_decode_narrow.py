"""MLA decode stage 1 in Gluon for few heads (H = 16, DeepSeek-V3 under TP8) on Hopper: keys-major wgmma.

Shape legend as in mla_decode.py: B requests, H heads, C = kv_lora + rope, P = num_kv_splits; one program =
(16-head block, request, split), one warpgroup (4 warps). Per 64-key tile, everything transposed so that the
64 keys are the wgmma's M (its smallest, 64) and the 16 heads its N:

    S^T [64 keys, 16 heads]   = c_kv k-tile @ q_nope^T + k_pe @ q_pe^T    A = the latent tile, B = q (smem)
    P^T = exp2(S^T - m)       -> shared memory (bf16, 2 KB)
    O^T [kv_lora, 16 heads]  += c_kv^T @ P^T                               A = the same tile, transposed

Why: the Triton tile (16 heads x 32 keys, mma.sync, two programs an SM) spends ~706 instructions a warp and 9
barriers a 32-key tile and issues 0.33 instructions a cycle, latency-bound at 12.5% occupancy (bench/NOTES.md,
"mla16b, session 5"): at 19-151 MB it reaches 34-74% of copy bandwidth. Here a 64-key tile is 36 + 32 wgmma
instructions with both operands in shared memory, the tile arrives as TMA boxes on an mbarrier (no per-thread
gather), and the softmax needs 2 barriers (the column max exchanged between the 4 warps, each holding 16 keys;
P^T written). The head dimension N = 16 costs nothing extra (no padding of 16 heads to 64 rows).

Shared memory: q 18 KB, two stages of the tile (c_kv [64, 512] + k_pe [64, 64]) 144 KB, P^T 2 KB: one program an
SM, 72 KB in flight per SM while it computes the other stage. The O^T accumulator is 64 fp32 registers a thread.
Only the TMA form exists: pages of a multiple of 64 slots (a tile's keys are 64 consecutive cache rows, as the
wide kernel's tma_usable); other page sizes take the Triton kernel (mla_decode's launcher decides).
Writes the same partials and LSEs as the Triton stage 1 (mla_decode's merge is shared). Not under
TRITON_INTERPRET (Gluon); covered by gpu-marked tests. Requires sm_90, bf16/fp16, kv_lora in {128, 256, 512},
rope a power of two in 16..128.
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

from r3trace.kernels.mla_decode_gluon import GLUON_KV_LORA, GLUON_ROPE, TMA_PAGE, tma_usable

BLOCK_H = 16  # the wgmma's N: 16 heads, no padding
BLOCK_N = 64  # keys a tile: the wgmma's M, 16 per warp
NUM_WARPS = 4  # one warpgroup
# EARLY_REFILL: the next tile's TMA issued after a barrier at the top of the tile (3 barriers a tile), not after
# the column max's barrier (2 a tile, the refill ~the score wgmmas later).
FLAGS = {"EARLY_REFILL": False}


@gluon.jit
def _expect(kv_desc, kr_desc, bv, br, pred):
    """Arms a stage's two mbarriers with its boxes' bytes (before the CTA barrier that its copies follow: triton
    3.6 puts a barrier between any two accesses of one mbarrier allocation that no barrier separates)."""
    mbarrier.expect(bv, kv_desc.block_type.nbytes, pred=pred)
    mbarrier.expect(br, kr_desc.block_type.nbytes, pred=pred)


@gluon.jit
def _copy(kv_desc, kr_desc, bv, br, kv_s, kr_s, slot, pred, KV_LORA: gl.constexpr):
    """A stage's two TMA boxes (c_kv [64, kv_lora], k_pe [64, rope]) from cache row `slot` on."""
    tma.async_copy_global_to_shared(kv_desc, [slot, 0], bv, kv_s, pred=pred)
    tma.async_copy_global_to_shared(kr_desc, [slot, KV_LORA], br, kr_s, pred=pred)


@gluon.jit
def _tile(
    t, start, end, num_tiles, qk_scale, qv_s, qr_s, mx_s, p_s, kv_t, kr_t, bv_t, br_t, kv_n, kr_n, bv_n, br_n,
    kv_desc, kr_desc, r2t, slot_n, keys, s_zero, m_i, l_e, acc,
    KV_LORA: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr, O_LAYOUT: gl.constexpr,
    EARLY_REFILL: gl.constexpr,
):  # fmt: skip
    """Tile t from (kv_t, kr_t), tile t+1's boxes issued into (kv_n, kr_n) once every warp finished P V of t-1."""
    more = t + 1 < num_tiles
    _expect(kv_desc, kr_desc, bv_n, br_n, more)
    if EARLY_REFILL:
        gl.thread_barrier()  # every warp waited for its P V of tile t-1: the other stage is free
        _copy(kv_desc, kr_desc, bv_n, br_n, kv_n, kr_n, slot_n, more, KV_LORA)
    mbarrier.wait(bv_t, (t // 2) & 1)  # tile t's boxes (and q's, with tile 0) landed: the (t // 2)-th phase
    mbarrier.wait(br_t, (t // 2) & 1)
    s = warpgroup_mma(kv_t, qv_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma(kr_t, qr_s.permute((1, 0)), s, is_async=True)
    n2 = start + (t + 2) * BLOCK_N  # tile t+2's first slot, for the refill of the next call
    slot_n2 = gl.load(r2t + n2, mask=n2 < end, other=0).to(gl.int32)
    s = warpgroup_mma_wait(0, deps=(s,))
    visible = (start + t * BLOCK_N + keys) < end
    s = gl.where(visible[:, None], s * qk_scale, float("-inf"))  # [keys, heads], log2 units
    # the column max over 64 keys: each warp's over its 16 (shuffles), then the 4 swapped through 256 B of
    # shared memory with one barrier (gl.max over axis 0 crosses the warps with two)
    warp_max = gl.max(gl.reshape(s, [4, BLOCK_N // 4, BLOCK_H]), axis=1)  # [4 warps, heads]
    mx_s.store(gl.reshape(warp_max, [4 * BLOCK_H]))
    gl.thread_barrier()  # also: every warp waited for its P V of tile t-1
    if not EARLY_REFILL:
        _copy(kv_desc, kr_desc, bv_n, br_n, kv_n, kr_n, slot_n, more, KV_LORA)
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
    return slot_n2, m_new, l_e, acc


@gluon.jit
def _mla_decode_narrow_kernel(
    # pointers and TMA descriptors
    req_to_token_ptr, req_pool_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, qv_desc, qr_desc, kv_desc, kr_desc,
    # sizes
    H, num_kv_splits, split_align, qk_scale,
    # strides
    stride_rtr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    # constexpr
    KV_LORA: gl.constexpr, ROPE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, OUT_LAYOUT: gl.constexpr, P_SMEM: gl.constexpr,
    EARLY_REFILL: gl.constexpr,
):  # fmt: skip
    hb = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
    req_row = gl.load(req_pool_ptr + b).to(gl.int64)
    split_len = gl.cdiv(gl.cdiv(seq_len, num_kv_splits), split_align) * split_align
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)
    if start < end:  # else: more splits than this request needs; stage 2 skips the split too
        dtype: gl.constexpr = kv_desc.dtype
        qv_s = gl.allocate_shared_memory(dtype, [BLOCK_H, KV_LORA], qv_desc.layout)
        qr_s = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], qr_desc.layout)
        # two stages, separate allocations (the wide kernel's reason: one [2, ...] allocation indexed by t % 2
        # makes the compiler's hazard analysis add barriers between the refill and the reads)
        kv_a = gl.allocate_shared_memory(dtype, [BLOCK_N, KV_LORA], kv_desc.layout)
        kr_a = gl.allocate_shared_memory(dtype, [BLOCK_N, ROPE], kr_desc.layout)
        kv_b = gl.allocate_shared_memory(dtype, [BLOCK_N, KV_LORA], kv_desc.layout)
        kr_b = gl.allocate_shared_memory(dtype, [BLOCK_N, ROPE], kr_desc.layout)
        p_s = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H], P_SMEM)
        mx_s = gl.allocate_shared_memory(gl.float32, [4 * BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        bv_a = gl.allocate_shared_memory(gl.int64, [1], bar_layout)  # one mbarrier a box and stage
        br_a = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        bv_b = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        br_b = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        mbarrier.init(bv_a, count=1)
        mbarrier.init(br_a, count=1)
        mbarrier.init(bv_b, count=1)
        mbarrier.init(br_b, count=1)
        fence_async_shared()  # the inits visible to the TMA unit before it signals them
        r2t = req_to_token_ptr + req_row * stride_rtr
        # q [16 heads, C] as rows b H + 16 hb of q viewed [B H, C], on tile 0's mbarriers: one latency. Rows past
        # this request's heads (H < 16: the next request's; past B H: zero-filled) are columns never stored.
        q_row = b * H + hb * BLOCK_H
        mbarrier.expect(bv_a, qv_desc.block_type.nbytes + kv_desc.block_type.nbytes)
        mbarrier.expect(br_a, qr_desc.block_type.nbytes + kr_desc.block_type.nbytes)
        gl.thread_barrier()
        tma.async_copy_global_to_shared(qv_desc, [q_row, 0], bv_a, qv_s)
        tma.async_copy_global_to_shared(qr_desc, [q_row, KV_LORA], br_a, qr_s)
        _copy(kv_desc, kr_desc, bv_a, br_a, kv_a, kr_a, gl.load(r2t + start).to(gl.int32), True, KV_LORA)
        n1 = start + BLOCK_N  # tile 1's first slot, one tile early (the refill waits on no load)
        slot_n = gl.load(r2t + n1, mask=n1 < end, other=0).to(gl.int32)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, S_LAYOUT))
        l_e = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=S_LAYOUT)
        acc = gl.zeros([KV_LORA, BLOCK_H], gl.float32, layout=O_LAYOUT)
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=S_LAYOUT)
        keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_LAYOUT))
        num_tiles = gl.cdiv(end - start, BLOCK_N)
        for t in range(0, num_tiles, 2):
            slot_n, m_i, l_e, acc = _tile(
                t, start, end, num_tiles, qk_scale, qv_s, qr_s, mx_s, p_s, kv_a, kr_a, bv_a, br_a, kv_b, kr_b, bv_b,
                br_b, kv_desc, kr_desc, r2t, slot_n, keys, s_zero, m_i, l_e, acc,
                KV_LORA, BLOCK_N, BLOCK_H, O_LAYOUT, EARLY_REFILL)  # fmt: skip
            if t + 1 < num_tiles:
                slot_n, m_i, l_e, acc = _tile(
                    t + 1, start, end, num_tiles, qk_scale, qv_s, qr_s, mx_s, p_s, kv_b, kr_b, bv_b, br_b, kv_a, kr_a,
                    bv_a, br_a, kv_desc, kr_desc, r2t, slot_n, keys, s_zero, m_i, l_e, acc,
                    KV_LORA, BLOCK_N, BLOCK_H, O_LAYOUT, EARLY_REFILL)  # fmt: skip

        l_i = gl.sum(l_e, axis=0)  # [heads]: the one cross-warp reduction of the sums
        out = acc / gl.convert_layout(l_i, gl.SliceLayout(0, O_LAYOUT))[None, :]  # O^T [kv_lora, heads]
        # through shared memory to a layout with the kv_lora columns fastest: 16-byte stores along a partial's row
        out = gl.convert_layout(out.to(part_out_ptr.dtype.element_ty), OUT_LAYOUT)
        c_o = gl.arange(0, KV_LORA, layout=gl.SliceLayout(1, OUT_LAYOUT))
        h_o = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, OUT_LAYOUT))
        part = part_out_ptr + b * stride_pb + h_o[None, :] * stride_ph + split * stride_ps + c_o[:, None]
        gl.store(part, out, mask=(h_o < H)[None, :])  # one split: part_out is the output itself
        h_s = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, S_LAYOUT))
        gl.store(part_lse_ptr + b * stride_lb + h_s * stride_lh + split, m_i + gl.log2(l_i), mask=h_s < H)


def _layouts(kv_lora: int, dtype: Any, out_bytes: int) -> dict[str, Any]:
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_H, 16])
    vec = 16 // out_bytes  # 16-byte stores: 4 fp32 partials, 8 bf16 outputs
    return {
        "S_LAYOUT": acc,  # S^T [64, 16]: one wgmma M block, 16 keys a warp
        "O_LAYOUT": acc,  # O^T [kv_lora, 16]: kv_lora / 64 M blocks
        "OUT_LAYOUT": gl.BlockedLayout([vec, 1], [min(32, kv_lora // vec), 32 // min(32, kv_lora // vec)],
                                       [1, NUM_WARPS], [0, 1]),  # fmt: skip
        "P_SMEM": gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype),
    }


def narrow_supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora: int, page_size: int) -> str | None:
    """None when this kernel can run these inputs, else why not (the launcher raises it)."""
    rope = q.shape[2] - kv_lora
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the narrow Gluon decode kernel needs a Hopper (sm_90) GPU"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the narrow Gluon decode kernel takes bf16/fp16, not {q.dtype}"
    if kv_lora not in GLUON_KV_LORA or rope not in GLUON_ROPE:
        return f"the narrow Gluon decode kernel needs kv_lora in {GLUON_KV_LORA} and rope in {GLUON_ROPE}"
    if not tma_usable(q, kv_cache, page_size):
        return (f"the narrow Gluon decode kernel loads tiles by TMA: page_size {page_size} must be a multiple of "
                f"{TMA_PAGE}, q contiguous, 16-byte aligned rows")  # fmt: skip
    return None


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
    split_align: int,
    flags: dict[str, bool] | None = None,
) -> None:
    """Fills part_out [B, H, P, kv_lora] (fp32, or the output itself at P = 1) and part_lse [B, H, P] (log2 units)
    as the Triton stage 1. The caller has checked narrow_supported (pages of a multiple of 64 slots);
    split_align must be a multiple of 64 (each split whole tiles of consecutive rows)."""
    B, H, C = q.shape
    rope = C - kv_lora_rank
    num_kv_splits = part_out.shape[2]
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    nvmma = gl.NVMMASharedLayout.get_default_for
    qf = q.view(B * H, C)
    rows = kv_cache.shape[0]
    descs = (
        TensorDescriptor(qf, [B * H, C], [C, 1], [BLOCK_H, kv_lora_rank], nvmma([BLOCK_H, kv_lora_rank], gdt)),
        TensorDescriptor(qf, [B * H, C], [C, 1], [BLOCK_H, rope], nvmma([BLOCK_H, rope], gdt)),
        TensorDescriptor(kv_cache, [rows, C], [kv_cache.stride(0), 1], [BLOCK_N, kv_lora_rank],
                         nvmma([BLOCK_N, kv_lora_rank], gdt)),  # fmt: skip
        TensorDescriptor(kv_cache, [rows, C], [kv_cache.stride(0), 1], [BLOCK_N, rope], nvmma([BLOCK_N, rope], gdt)),
    )
    grid = ((H + BLOCK_H - 1) // BLOCK_H, B, num_kv_splits)
    _mla_decode_narrow_kernel[grid](
        req_to_token, req_pool_indices, seq_lens, part_out, part_lse, *descs,
        H, num_kv_splits, split_align, qk_scale,
        req_to_token.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        KV_LORA=kv_lora_rank, ROPE=rope, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        **_layouts(kv_lora_rank, gdt, part_out.element_size()), **(FLAGS | (flags or {})), num_warps=NUM_WARPS,
    )  # fmt: skip
