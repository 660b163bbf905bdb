"""How the Gluon MLA decode kernels bring q and the latent cache into shared memory (wide.py, 64-head
blocks over 8 warps; narrow.py, 16-head blocks over 4): a 64-key tile is either two TMA boxes on
mbarriers, c_kv [64, kv_lora] and k_pe [64, rope] from one cache row on (pages of a multiple of 64 slots, so the
tile's keys are consecutive rows), or one cp.async copy a row through req_to_token (any page size; masked rows
past the split's end are zero-filled and read no memory). q arrives beside tile 0, on its mbarriers or in its
cp.async group, so the two latencies overlap. Gluon functions inline: each kernel compiles to what it did with
these lines in place (checked offline, triton 3.6, sm_90a: the TMA forms to the same SASS, the cp.async forms to
the same instructions with other register numbers).
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from r3trace.kernels.mla_decode.registry import TMA_PAGE


def tma_usable(q: torch.Tensor, kv_cache: torch.Tensor, page_size: int) -> bool:
    """The TMA form's conditions: whole 64-key tiles on consecutive rows (page_size a multiple of TMA_PAGE), q rows
    contiguous as [B H, C] (its descriptor's view), 16-byte aligned bases and row strides (TMA's rule). A last tile's
    rows past the request's end are then loaded too (real slots of its page, where cp.async zero-fills): their
    scores are masked, P = 0, so they must hold finite values (0 x NaN is NaN). The engine's pool starts zeroed and
    only ever holds latents written by the model."""
    return (
        page_size % TMA_PAGE == 0
        and q.is_contiguous()
        and kv_cache.stride(1) == 1
        and q.data_ptr() % 16 == 0
        and kv_cache.data_ptr() % 16 == 0
        and (kv_cache.stride(0) * kv_cache.element_size()) % 16 == 0
    )


def tile_descriptors(
    q: torch.Tensor, kv_cache: torch.Tensor, kv_lora: int, block_h: int, block_n: int, layouts: dict[str, Any]
) -> tuple[TensorDescriptor, ...]:
    """The TMA form's four descriptors: q viewed [B H, C] with a [block_h, kv_lora] and a [block_h, rope] box, the
    cache [S, C] with a [block_n, kv_lora] and a [block_n, rope] box (rope boxes at column kv_lora). Boxes past 128
    bytes a row: triton 3.6 splits them along the 128 B swizzle (8 copies of [rows, 64] at kv_lora 512), as the
    wgmma's NVMMASharedLayout stores them."""
    B, H, C = q.shape
    qf, rope, rows = q.view(B * H, C), C - kv_lora, kv_cache.shape[0]
    return (
        TensorDescriptor(qf, [B * H, C], [C, 1], [block_h, kv_lora], layouts["QV_SMEM"]),
        TensorDescriptor(qf, [B * H, C], [C, 1], [block_h, rope], layouts["QR_SMEM"]),
        TensorDescriptor(kv_cache, [rows, C], [kv_cache.stride(0), 1], [block_n, kv_lora], layouts["KV_SMEM"]),
        TensorDescriptor(kv_cache, [rows, C], [kv_cache.stride(0), 1], [block_n, rope], layouts["KR_SMEM"]),
    )


@gluon.jit
def grid_dependency_wait():
    """griddepcontrol.wait (triton.language.extra.cuda.gdc_wait, for Gluon): under programmatic dependent launch the
    kernel before may still run; it may have written q and each request's newest cache row, and the previous call's
    merge may still read the partials this program overwrites, so none of those is touched before this. The index
    tables (seq_lens, req_pool_indices, req_to_token) are read before it (split_bounds, the TMA form's first two
    slots), and so is, in the narrow kernel's TMA form, a tile 0 that holds no request's last position
    (tma_first_tile): DecodeTile.pdl's contract."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def launch_dependents():
    """griddepcontrol.launch_dependents: the merge may launch (and wait) once every program here has called it."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


def gather_layout(cols: int, num_warps: int) -> gl.BlockedLayout:
    """16-byte cp.async per thread along a row, as many threads along the row as it has 8-column chunks."""
    tc = min(32, cols // 8)
    return gl.BlockedLayout([1, 8], [32 // tc, tc], [num_warps, 1], [1, 0])


@gluon.jit
def expect_tile(kv_desc, kr_desc, bv, br, pred):
    """Arms one stage's two mbarriers with its boxes' bytes (one thread). Before the CTA barrier its copies follow:
    triton 3.6 puts a barrier between any two accesses of one mbarrier allocation that no barrier separates."""
    mbarrier.expect(bv, kv_desc.block_type.nbytes, pred=pred)
    mbarrier.expect(br, kr_desc.block_type.nbytes, pred=pred)


@gluon.jit
def copy_tile(kv_desc, kr_desc, bv, br, kv_s, kr_s, slot, pred, KV_LORA: gl.constexpr):
    """One tile's two TMA boxes from cache row `slot` on (triton 3.6 splits a [64, 512] box into one [64, 64] box a
    warp, along the 128 B swizzle)."""
    tma.async_copy_global_to_shared(kv_desc, [slot, 0], bv, kv_s, pred=pred)
    tma.async_copy_global_to_shared(kr_desc, [slot, KV_LORA], br, kr_s, pred=pred)


@gluon.jit
def stage_barriers():
    """One mbarrier a box and stage, each its own allocation (one [4] allocation makes triton 3.6 separate every
    access to it by a barrier): c_kv and k_pe of even tiles, then of odd tiles. Initialised and fenced."""
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    bv_a = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    br_a = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    bv_b = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    br_b = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    mbarrier.init(bv_a, count=1)
    mbarrier.init(br_a, count=1)
    mbarrier.init(bv_b, count=1)
    mbarrier.init(br_b, count=1)
    fence_async_shared()  # the inits visible to the TMA unit before it signals them
    return bv_a, br_a, bv_b, br_b


@gluon.jit
def split_bounds(seq_lens_ptr, req_pool_ptr, req_to_token_ptr, stride_rtr, b, split, num_kv_splits, split_align):
    """Split `split` of request b: its first and past-the-end positions (start >= end: no keys), the request's length
    and its req_to_token row. The splits of a request are split_align-aligned ceil(seq_len / num_kv_splits) runs."""
    seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
    req_row = gl.load(req_pool_ptr + b).to(gl.int64)
    split_len = gl.cdiv(gl.cdiv(seq_len, num_kv_splits), split_align) * split_align
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)
    return start, end, seq_len, req_to_token_ptr + req_row * stride_rtr


@gluon.jit
def tma_first_tile(
    qv_desc, qr_desc, kv_desc, kr_desc, qv_s, qr_s, kv_s, kr_s, bv, br, q_row, slot, early, PDL: gl.constexpr,
    KV_LORA: gl.constexpr,
):  # fmt: skip
    """q's rows q_row.. of q viewed [B H, C] and tile 0 (from cache row `slot`, first_slot of the split's start), all
    on tile 0's two mbarriers. Rows past the request's heads (the next request's, or zero-filled past B H) are heads
    never stored. PDL: the caller has not waited yet; tile 0 is issued before griddepcontrol.wait where `early` (its
    keys hold none of the request's last position, the one row the kernel launched just before may have written:
    DecodeTile.pdl), q and a late tile 0 after it. Without PDL `early` is unused."""
    mbarrier.expect(bv, qv_desc.block_type.nbytes + kv_desc.block_type.nbytes)
    mbarrier.expect(br, qr_desc.block_type.nbytes + kr_desc.block_type.nbytes)
    gl.thread_barrier()
    if PDL:
        copy_tile(kv_desc, kr_desc, bv, br, kv_s, kr_s, slot, early, KV_LORA)
        grid_dependency_wait()
        launch_dependents()
        late = early == 0
    else:
        late = True
    tma.async_copy_global_to_shared(qv_desc, [q_row, 0], bv, qv_s)
    tma.async_copy_global_to_shared(qr_desc, [q_row, KV_LORA], br, qr_s)
    copy_tile(kv_desc, kr_desc, bv, br, kv_s, kr_s, slot, late, KV_LORA)


@gluon.jit
def first_slot(r2t, n0, end):
    """The cache row of position n0 (a TMA tile's first key), 0 past `end` (that tile is never loaded)."""
    return gl.load(r2t + n0, mask=n0 < end, other=0).to(gl.int32)


@gluon.jit
def row_slots(r2t, n0, rows_v, rows_r, end, SLOT_DTYPE: gl.constexpr):
    """The cache rows of positions n0 + rows (a gathered tile's keys) in both gather layouts, with their masks
    (rows past `end` are not copied). SLOT_DTYPE: what the caller carries across its loop (int32 holds fewer
    registers; gather_rows widens at the address)."""
    m_v = (n0 + rows_v) < end
    m_r = (n0 + rows_r) < end
    sl_v = gl.load(r2t + n0 + rows_v, mask=m_v, other=0).to(SLOT_DTYPE)
    sl_r = gl.load(r2t + n0 + rows_r, mask=m_r, other=0).to(SLOT_DTYPE)
    return sl_v, sl_r, m_v, m_r


@gluon.jit
def gather_rows(kv_s, kr_s, kv_ptr, sl_v, sl_r, m_v, m_r, cols_v, cols_r, stride_kvs):
    """One tile as cp.async row copies: c_kv columns by GATHER_V's layout, k_pe by GATHER_R's (not committed)."""
    async_copy.async_copy_global_to_shared(
        kv_s, kv_ptr + sl_v.to(gl.int64)[:, None] * stride_kvs + cols_v[None, :], mask=m_v[:, None]
    )
    async_copy.async_copy_global_to_shared(
        kr_s, kv_ptr + sl_r.to(gl.int64)[:, None] * stride_kvs + cols_r[None, :], mask=m_r[:, None]
    )


@gluon.jit
def gather_first_tile(
    q_ptr, kv_ptr, r2t, qv_s, qr_s, kv_s, kr_s, b, h0, H, start, end, stride_qb, stride_qh, stride_kvs,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, KV_LORA: gl.constexpr, ROPE: gl.constexpr,
    GATHER_V: gl.constexpr, GATHER_R: gl.constexpr,
):  # fmt: skip
    """q's heads h0..h0+BLOCK_H-1 (masked past H, zero-filled) and tile 0's rows by cp.async, one committed group.
    Returns the row and column index vectors every later gather reuses."""
    rows_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GATHER_V))
    cols_v = gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, GATHER_V))
    rows_r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GATHER_R))
    cols_r = KV_LORA + gl.arange(0, ROPE, layout=gl.SliceLayout(0, GATHER_R))
    h_v = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GATHER_V))
    h_r = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, GATHER_R))
    q_b = q_ptr + b * stride_qb
    async_copy.async_copy_global_to_shared(
        qv_s, q_b + h_v[:, None] * stride_qh + cols_v[None, :], mask=(h_v < H)[:, None]
    )
    async_copy.async_copy_global_to_shared(
        qr_s, q_b + h_r[:, None] * stride_qh + cols_r[None, :], mask=(h_r < H)[:, None]
    )
    sl_v, sl_r, m_v, m_r = row_slots(r2t, start, rows_v, rows_r, end, gl.int64)
    gather_rows(kv_s, kr_s, kv_ptr, sl_v, sl_r, m_v, m_r, cols_v, cols_r, stride_kvs)
    async_copy.commit_group()
    return rows_v, rows_r, cols_v, cols_r
