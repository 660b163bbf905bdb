"""Stage 1 of the batch-invariant MLA attention (fixed_split.py): one program = (head block, a block of consecutive
query rows of one request, one fixed 256-key split), so the rows of a prompt chunk or a verify share each latent tile
they read, as a flash prefill's query tile does, while every row's arithmetic is the one a lone decode row gets.

Shape legend as in decode.py: T query rows, B requests, H heads, C = kv_lora + rope, P splits. A program's tile is
ROWS = BM tokens x HB heads rows (token-major: row r is token r // HB, head r % HB); the query block is
[ROWS, C] and every product and row reduction runs on [ROWS, BLOCK_N] tiles of one fixed shape (TokenBlockTile).

Why a row's bits do not depend on its block: the program's constexprs are the same for a decode step, a verify of
d + 1 rows and a prefill chunk of any length; every product, max and sum is per row of the tile, and a row sees
the same tiles of keys (split p covers positions [p * SPLIT, (p + 1) * SPLIT), walked in BLOCK_N steps from the
split's start). The one difference a block makes is that a row may walk key tiles past its own last key (another
row of the block needs them): those tiles are masked to -inf for it, so its running max stays, alpha = exp2(0) = 1
and the tile adds p = 0 to its sum and 0 x value to its accumulator, which leaves both unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from r3trace.kernels.dot import dot_precision, row_mma

# Query rows a program: 64 fills the M side of the tensor-core products (wgmma's 64-row atom on Hopper); the H >= 64
# Triton decode tile (tile.py, 64 heads x 64 keys over 8 warps) holds a [64, kv_lora] fp32 accumulator the same way.
TILE_ROWS = 64


class TokenBlockTile(NamedTuple):
    """heads x tokens = the program's query rows; block_n keys a step; warps and stages of the launch (stages: a
    launch of fewer than PREFILL_ROWS rows a request; prefill_stages: from PREFILL_ROWS). Stages only pipeline the
    key loads: a row's arithmetic is the same under either count."""

    heads: int
    tokens: int
    block_n: int
    num_warps: int
    num_stages: int
    prefill_stages: int


# A launch whose longest request has this many rows (a prefill chunk) pipelines its key tiles 3 deep: at H = 16, an
# 8 x 2048 prefill layer 3.99 vs 4.29 ms on the H200; decode rows keep 2 (329 vs 259 us for 3 at batch 64).
PREFILL_ROWS = 64


def token_block_tile(num_heads: int, dtype: torch.dtype) -> TokenBlockTile:
    """H >= 64: 64 heads of one token (the decode tile's shape); fewer heads: the next power of two of H, times
    as many tokens as fill 64 rows (H = 16: 4 tokens a program, each latent tile read once for 4 prompt rows).
    fp32 halves the keys a step (two fp32 tiles in shared memory), as the decode tile does."""
    heads = min(TILE_ROWS, triton.next_power_of_2(max(1, num_heads)))
    wide16 = dtype.itemsize <= 2  # fp32: half the keys a step, and 2 stages (3 would not fit the shared memory)
    return TokenBlockTile(heads, TILE_ROWS // heads, 64 if wide16 else 32, 8, 2, 3 if wide16 else 2)


@triton.jit
def _token_block_kernel(
    # pointers
    q_ptr, kv_ptr, req_to_token_ptr, req_pool_ptr, q_start_ptr, q_lens_ptr, row_keys_ptr, part_out_ptr, part_lse_ptr,
    row_split_ptr,
    # sizes
    H, blocks_per_req, num_splits, qk_scale,
    # strides
    stride_qt, stride_qh, stride_kvs, stride_rtr, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    # constexpr
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, DYNAMIC: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    hb = tl.program_id(0)
    b = tl.program_id(1) // blocks_per_req
    first = (tl.program_id(1) % blocks_per_req) * BM  # the block's first row within its request
    split = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + b).to(tl.int32)
    if first >= q_len:  # a request with fewer rows than the longest: no block here
        return
    q0 = tl.load(q_start_ptr + b).to(tl.int32) + first  # the block's first row in T
    req_row = tl.load(req_pool_ptr + b).to(tl.int64)

    offs_m = tl.arange(0, HB * BM)  # token-major rows: token m // HB, head m % HB
    tok = offs_m // HB
    head = hb * HB + offs_m % HB
    row_ok = (first + tok < q_len) & (head < H)
    keys = tl.load(row_keys_ptr + q0 + tok, mask=row_ok, other=0).to(tl.int32)  # each row's own key count
    if DYNAMIC:  # the block's longest row in num_splits whole tiles of >= SPLIT keys each; the merge reads it back
        longest = tl.max(tl.where(row_ok, keys, 0), axis=0)
        split_len = tl.cdiv(tl.maximum(tl.cdiv(longest, num_splits), SPLIT), BLOCK_N) * BLOCK_N
        if (split == 0) & (hb == 0):
            tl.store(row_split_ptr + q0 + tok, split_len + 0 * tok, mask=row_ok & (offs_m % HB == 0))
    else:
        split_len = SPLIT
    start = split * split_len
    end = tl.minimum(start + split_len, keys)  # [ROWS]: this split's keys for each row
    block_end = tl.max(tl.where(row_ok, end, 0), axis=0)
    if start >= block_end:  # no row of the block reaches this split: the merge skips it too
        return

    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_mask = offs_c < KV_LORA
    r_mask = offs_r < ROPE
    q_rows = q_ptr + (q0 + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_v = tl.load(q_rows + offs_c[None, :], mask=row_ok[:, None] & c_mask[None, :], other=0.0)
    q_pe = tl.load(q_rows + KV_LORA + offs_r[None, :], mask=row_ok[:, None] & r_mask[None, :], other=0.0)

    m_i = tl.full((HB * BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((HB * BM,), tl.float32)
    acc = tl.zeros((HB * BM, BLOCK_C), tl.float32)
    r2t_row = req_to_token_ptr + req_row * stride_rtr
    for n0 in range(start, block_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < block_end
        slots = tl.load(r2t_row + offs_n, mask=n_mask, other=0)
        rows = kv_ptr + slots.to(tl.int64)[:, None] * stride_kvs
        kv = tl.load(rows + offs_c[None, :], mask=n_mask[:, None] & c_mask[None, :], other=0.0)  # [N, C]
        k_pe = tl.load(rows + KV_LORA + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        s = row_mma(q_v, tl.trans(kv), UPCAST, INPUT_PRECISION)
        s += row_mma(q_pe, tl.trans(k_pe), UPCAST, INPUT_PRECISION)
        # each row's own keys: past a row's end (another row of the block reads on) its scores are -inf
        s = tl.where(offs_n[None, :] < end[:, None], s * qk_scale, float("-inf"))  # [ROWS, N], log2 units
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # flash.online_softmax_step with row_mma
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet (dead rows): 0, not NaN
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + row_mma(p.to(kv.dtype), kv, UPCAST, INPUT_PRECISION)
        m_i = m_new

    live = row_ok & (start < end)  # rows with keys in this split; the others (l_i = 0) are not written
    l_i = tl.where(live, l_i, 1.0)
    t_rows = (q0 + tok).to(tl.int64)
    part = part_out_ptr + t_rows[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
    tl.store(part + offs_c[None, :], acc / l_i[:, None], mask=live[:, None] & c_mask[None, :])
    tl.store(part_lse_ptr + t_rows * stride_lt + head * stride_lh + split, m_i + tl.log2(l_i), mask=live)


def token_block_stage1(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    q_start: torch.Tensor,
    q_lens: torch.Tensor,
    row_keys: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    kv_lora_rank: int,
    qk_scale: float,
    tile: TokenBlockTile,
    split_keys: int,
    max_q_len: int,
    row_split: torch.Tensor | None = None,
) -> None:
    """Fills part_out [T, H, P, kv_lora] fp32 and part_lse [T, H, P] (log2 units) for every (row, split) with keys;
    request b's rows are q_start[b] .. q_start[b] + q_lens[b] - 1, row t sees positions 0 .. row_keys[t] - 1 of
    req_to_token row req_pool_indices[b]. qk_scale = sm_scale x log2(e); max_q_len: a host bound on q_lens.
    Split p covers positions [p x S, (p + 1) x S): S = split_keys, or with row_split [T] int32 (dynamic splits) S is
    a block's own, cut on the device from its longest row into P runs of whole tiles, >= split_keys keys each (a
    graph's host lengths, its longest context, never widen it), and written to row_split for each of its rows."""
    T, H, C = q.shape
    B = req_pool_indices.shape[0]
    blocks = triton.cdiv(max(1, max_q_len), tile.tokens)
    _token_block_kernel[(triton.cdiv(H, tile.heads), B * blocks, part_out.shape[2])](
        q, kv_cache, req_to_token, req_pool_indices, q_start, q_lens, row_keys, part_out, part_lse,
        row_split if row_split is not None else q_lens, H, blocks, part_out.shape[2], qk_scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), req_to_token.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        KV_LORA=kv_lora_rank, ROPE=C - kv_lora_rank, HB=tile.heads, BM=tile.tokens, BLOCK_N=tile.block_n,
        BLOCK_C=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_R=max(16, triton.next_power_of_2(C - kv_lora_rank)),
        SPLIT=split_keys, DYNAMIC=row_split is not None, UPCAST=not q.is_cuda,
        INPUT_PRECISION=dot_precision(q.dtype == torch.float32),
        num_warps=tile.num_warps, num_stages=tile.prefill_stages if max_q_len >= PREFILL_ROWS else tile.num_stages,
    )  # fmt: skip
