"""The pieces of one seesaw pair (seesaw.py: two warp-specialized warpgroups on alternate 64-key tiles):
the cross-warpgroup signal, a tile part's TMA refill, the scores over a tile's parts in refill order, and the half of
O's coalesced store. Gluon functions inline: the kernel compiles to what it would with these lines in place.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from r3trace.kernels.mla_decode.latent_tiles import first_slot


@gluon.jit
def bar():
    """One count-1 mbarrier in its own allocation (triton 3.6 separates every access to a shared allocation of
    several barriers by a CTA barrier; wide_tile.py says more)."""
    b = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(b, count=1)
    return b


@gluon.jit
def signal(bar):
    """Every thread of this warpgroup is done with what it wrote before (a barrier of the partition's warps), then
    one arrival: the generic-proxy writes are fenced for the wgmmas and TMA that read after the other side waits."""
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def load_part(kvh_desc, kr_desc, bar, kv_s, kr_s, r2t, n0, end, COL: gl.constexpr, WITH_COLS: gl.constexpr,
               WITH_ROPE: gl.constexpr, KV_LORA: gl.constexpr):  # fmt: skip
    """Of the tile from position n0 (< end): columns COL..COL + kv_lora / 2 into kv_s where WITH_COLS, the rope rows
    into kr_s where WITH_ROPE, all on `bar`. The caller's warpgroup is past a barrier after its last read."""
    HALF: gl.constexpr = KV_LORA // 2
    fence_async_shared()  # earlier generic stores to these rows (P) ordered before the TMA writes
    if WITH_COLS and WITH_ROPE:
        mbarrier.expect(bar, kvh_desc.block_type.nbytes + kr_desc.block_type.nbytes)
    elif WITH_COLS:
        mbarrier.expect(bar, kvh_desc.block_type.nbytes)
    else:
        mbarrier.expect(bar, kr_desc.block_type.nbytes)
    slot = first_slot(r2t, n0, end)
    if WITH_COLS:
        tma.async_copy_global_to_shared(kvh_desc, [slot, COL], bar, kv_s.slice(COL, HALF, dim=1))
    if WITH_ROPE:
        tma.async_copy_global_to_shared(kr_desc, [slot, KV_LORA], bar, kr_s)


@gluon.jit
def score_part(s, qv_s, qr_s, kv_s, kr_s, PART: gl.constexpr, FIRST: gl.constexpr, HALF: gl.constexpr):
    """s += q K^T over one part of the tile: 0 the rope rows, 1 the left kv_lora / 2 columns, 2 the right ones."""
    if PART == 0:
        a = qr_s
        k = kr_s
    elif PART == 1:
        a = qv_s.slice(0, HALF, dim=1)
        k = kv_s.slice(0, HALF, dim=1)
    else:
        a = qv_s.slice(HALF, HALF, dim=1)
        k = kv_s.slice(HALF, HALF, dim=1)
    return warpgroup_mma(a, k.permute((1, 0)), s, use_acc=not FIRST, is_async=True)


@gluon.jit
def scores(qv_s, qr_s, kv_s, kr_s, bar_x, bar_y, bar_z, ph, pred, X: gl.constexpr, Y: gl.constexpr,
            Z: gl.constexpr, S_LAYOUT: gl.constexpr, KV_LORA: gl.constexpr):  # fmt: skip
    """S = q K^T, waited, over the tile's parts X, Y, Z (_score_part's numbers) in the order they are refilled, each
    product issued as soon as its part has landed (bar_x, bar_y, bar_z)."""
    HALF: gl.constexpr = KV_LORA // 2
    M: gl.constexpr = qv_s.shape[0]
    N: gl.constexpr = kv_s.shape[0]
    s = gl.zeros([M, N], gl.float32, layout=S_LAYOUT)
    mbarrier.wait(bar_x, ph, pred=pred)
    s = score_part(s, qv_s, qr_s, kv_s, kr_s, X, True, HALF)
    mbarrier.wait(bar_y, ph, pred=pred)
    s = score_part(s, qv_s, qr_s, kv_s, kr_s, Y, False, HALF)
    mbarrier.wait(bar_z, ph, pred=pred)
    s = score_part(s, qv_s, qr_s, kv_s, kr_s, Z, False, HALF)
    return warpgroup_mma_wait(0, deps=(s,))


@gluon.jit
def masked_scores(s, t, start, end, qk_scale, BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr):
    """The waited scores of tile t in log2 units, keys at or past `end` at -inf."""
    keys = start + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    return gl.where((keys < end)[None, :], s * qk_scale, float("-inf"))


@gluon.jit
def store_half(acc, l_sum, buf, part_out_ptr, b, hb, H, split, stride_pb, stride_ph, stride_ps,
                COL0: gl.constexpr, HALF: gl.constexpr, BLOCK_H: gl.constexpr, O_LAYOUT: gl.constexpr):  # fmt: skip
    """This warpgroup's O / l through `buf` (a dead tile buffer of >= 64 KB) to 16-byte stores along a row, as the
    wide kernel's COALESCED_OUT (1.12x at B64/1k there): from the accumulator's layout a thread would
    store 2 columns at a time, half a 32-byte sector in bf16."""
    dt: gl.constexpr = part_out_ptr.dtype.element_ty
    out = (acc / gl.convert_layout(l_sum, gl.SliceLayout(1, O_LAYOUT))[:, None]).to(dt)
    VEC: gl.constexpr = 128 // dt.primitive_bitwidth  # 16 bytes
    flat: gl.constexpr = gl.SwizzledSharedLayout(VEC, 1, 1, order=[1, 0])
    stage = buf._reinterpret(dt, [BLOCK_H, HALF], flat)
    stage.store(out)
    gl.thread_barrier()
    rows: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // HALF if HALF < 32 * VEC else 1,
                                          HALF // VEC if HALF < 32 * VEC else 32], [4, 1], [1, 0])  # fmt: skip
    o = stage.load(rows)
    h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows))
    c = COL0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, rows))
    part = part_out_ptr + b * stride_pb + h[:, None] * stride_ph + split * stride_ps + c[None, :]
    gl.store(part, o, mask=(h < H)[:, None])


@gluon.jit
def rows(v, O_LAYOUT: gl.constexpr):
    """A per-head vector broadcast over O's columns."""
    return gl.convert_layout(v, gl.SliceLayout(1, O_LAYOUT))[:, None]
