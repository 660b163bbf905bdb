"""MLA decode stage 1 in Triton ("triton" record): any GPU and the CPU interpreter; the default wherever no Gluon
record applies (package docstring). Shape legend as in decode.py. One program = (head block [x value split], request,
split): it walks its split of positions in tiles of BLOCK_N keys, gathering slots through req_to_token (any page
size), keeps an online softmax for BLOCK_H heads at once (one latent tile from HBM serves BLOCK_H query heads), and
writes the split's normalised partial output and its log-sum-exp for the merge (merge.py). The tile's knobs
(DecodeTile, tile.py): value splits (each half of the c_kv columns its own program, scores computed twice),
keys-major scores ([keys, heads]), and the next tile's slots loaded one iteration early at 3+ stages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from r3trace.kernels.dot import dot_precision
from r3trace.kernels.flash import latent_tile_split_scores, online_softmax_step, online_softmax_step_keys_major
from r3trace.kernels.mla_decode.registry import DecodeShape, Stage1
from r3trace.kernels.mla_decode.tile import DecodeTile


@triton.jit
def _mla_decode_kernel(
    # pointers
    q_ptr, kv_ptr, req_to_token_ptr, req_pool_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    # sizes
    H, num_kv_splits, split_align, qk_scale,
    # strides
    stride_qb, stride_qh, stride_kvs, stride_rtr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    # constexpr
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, V_SPLITS: tl.constexpr, KEYS_MAJOR: tl.constexpr,
    EARLY_SLOTS: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    FIXED_SPLIT: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched as a programmatic dependent: the previous kernel may still run; it may have written q,
        # kv, req_to_token or seq_lens, and the previous call's merge may still read the partials this
        # program overwrites, so nothing global is read or written before the wait
        gdc_wait()
        gdc_launch_dependents()  # the merge may launch (and wait) once every program of this grid is here
    # axis 0 = (head block, value split), fastest: the programs that read the same latent tiles start
    # side by side, so all but the first find the tile in L2 (H = 128, 64-head blocks: HBM read once).
    hb = tl.program_id(0) // V_SPLITS
    vs = tl.program_id(0) % V_SPLITS
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    req_row = tl.load(req_pool_ptr + b).to(tl.int64)
    # fixed-size splits (fixed_split.py): the ranges follow the row's own length only (a constexpr branch, not IfExp)
    if FIXED_SPLIT > 0:  # noqa: SIM108
        split_len = FIXED_SPLIT
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), split_align) * split_align  # whole tiles
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start >= end:  # short request, more splits than it needs: stage 2 skips this split too
        return

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = vs * BLOCK_V + tl.arange(0, BLOCK_V)  # the c_kv columns this program outputs
    offs_o = (1 - vs) * BLOCK_V + tl.arange(0, BLOCK_V)  # V_SPLITS = 2: the other half (scores only)
    offs_r = tl.arange(0, BLOCK_R)
    h_mask = offs_h < H
    v_mask = offs_v < KV_LORA
    o_mask = offs_o < KV_LORA
    r_mask = offs_r < ROPE
    q_rows = q_ptr + b * stride_qb + offs_h[:, None] * stride_qh
    q_v = tl.load(q_rows + offs_v[None, :], mask=h_mask[:, None] & v_mask[None, :], other=0.0)
    q_o = q_v
    if V_SPLITS == 2:
        q_o = tl.load(q_rows + offs_o[None, :], mask=h_mask[:, None] & o_mask[None, :], other=0.0)
    q_pe = tl.load(q_rows + KV_LORA + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_V), tl.float32)
    r2t_row = req_to_token_ptr + req_row * stride_rtr
    offs_n = start + tl.arange(0, BLOCK_N)
    slots = tl.load(r2t_row + offs_n, mask=offs_n < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if not EARLY_SLOTS:
            slots = tl.load(r2t_row + offs_n, mask=n_mask, other=0)
        rows = kv_ptr + slots.to(tl.int64)[:, None] * stride_kvs
        if EARLY_SLOTS:
            # The next tile's slots, one iteration early: the tile's gather then depends on no load of
            # its own iteration, and with num_stages >= 3 Triton issues it two tiles ahead (async_wait
            # num=2 in the TTGIR); loaded in-iteration, the copy went out at the end of the previous
            # iteration and was awaited (num=0) at the top of this one: no overlap with the products.
            slots = tl.load(r2t_row + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < end, other=0)
        s, kv = latent_tile_split_scores(
            q_v, q_o, q_pe, rows, offs_v, v_mask, offs_o, o_mask, KV_LORA + offs_r, r_mask, n_mask,
            V_SPLITS, KEYS_MAJOR, UPCAST, INPUT_PRECISION,
        )  # fmt: skip
        if KEYS_MAJOR:
            s = tl.where(n_mask[:, None], s * qk_scale, float("-inf"))  # [N, M], log2 units
            m_i, l_i, acc = online_softmax_step_keys_major(s, kv, m_i, l_i, acc, UPCAST, INPUT_PRECISION)
        else:
            s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))  # [M, N], log2 units
            m_i, l_i, acc = online_softmax_step(s, kv, m_i, l_i, acc, UPCAST, INPUT_PRECISION)

    out = acc / l_i[:, None]
    part = part_out_ptr + b * stride_pb + offs_h[:, None] * stride_ph + split * stride_ps + offs_v[None, :]
    tl.store(part, out.to(part_out_ptr.dtype.element_ty), mask=h_mask[:, None] & v_mask[None, :])  # fp32, or
    # the output dtype when the launcher points part_out at out (one split, no merge)
    if vs == 0:  # every value split computed the same scores: one writes the LSE
        tl.store(part_lse_ptr + b * stride_lb + offs_h * stride_lh + split, m_i + tl.log2(l_i), mask=h_mask)


def mla_decode_stage1_triton(
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
    fixed_split: int = 0,
) -> bool:
    """Fills part_out [B, H, P, kv_lora] (fp32, or the output itself at P = 1) and part_lse [B, H, P] (log2 units);
    qk_scale = sm_scale x log2(e); pdl: launched as a programmatic dependent (sm_90+), waiting before any global
    access. No cluster form: cluster > 1 launches nothing and returns False. fixed_split > 0 (a multiple of
    tile.block_n): split p covers positions [p * fixed_split, (p + 1) * fixed_split) of each request, whatever P."""
    if cluster > 1:
        return False
    B, H, C = q.shape
    num_kv_splits = part_out.shape[2]
    block_c = max(16, triton.next_power_of_2(kv_lora_rank))  # kv_lora and rope padded to powers of two (>= 16)
    block_r = max(16, triton.next_power_of_2(C - kv_lora_rank))
    _mla_decode_kernel[(tile.head_programs(H), B, num_kv_splits)](
        q, kv_cache, req_to_token, req_pool_indices, seq_lens, part_out, part_lse,
        H, num_kv_splits, tile.block_n, qk_scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), req_to_token.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        KV_LORA=kv_lora_rank, ROPE=C - kv_lora_rank, BLOCK_H=tile.block_h, BLOCK_N=tile.block_n,
        BLOCK_V=block_c // tile.v_splits, BLOCK_R=block_r, V_SPLITS=tile.v_splits, KEYS_MAJOR=tile.keys_major,
        EARLY_SLOTS=tile.num_stages >= 3, UPCAST=not q.is_cuda, INPUT_PRECISION=dot_precision(q.dtype == torch.float32),
        PDL=pdl, FIXED_SPLIT=fixed_split, num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return True


def _supported(shape: DecodeShape, dtype: torch.dtype, page_size: int) -> str | None:
    """Any float dtype, any latent shape, any page size (req_to_token gathers each key's row)."""
    return None


STAGE1 = Stage1("triton", hopper=False, fixed_tile=None, supported=_supported, launch=mla_decode_stage1_triton)
