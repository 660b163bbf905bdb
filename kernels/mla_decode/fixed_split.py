"""Batch-invariant MLA attention (EngineConfig.batch_invariant): fixed-size KV splits merged in a fixed order, so a
query row's output depends on its own key count and keys only, not on the batch, the grid, the SM count, or whether
the row is a decode step, one of a verify's d + 1 rows or a row of a prefill chunk.

Shape legend as in decode.py: T query rows, B requests (each a run of consecutive rows of T with its own key counts),
H heads, C = kv_lora + rope, P splits.

Why: mla_decode picks its split count P from the batch size, the longest row and the SM count (tile.py), and a row's
keys are cut into P runs of cdiv(seq_len, P) keys: the same request reads its keys in a different order at batch 1
and at batch 32, and a verify's rows went through the extend kernel, whose tiles differ again. Here split p of a row
always covers positions [p * SPLIT_KEYS, (p + 1) * SPLIT_KEYS) (token_block.py's stage 1, one tile shape for every
row: why a row's bits do not depend on its block is said there), the grid's P only bounds the longest row (splits
past a row's length return at once), and the merge walks the row's cdiv(keys, SPLIT_KEYS) partials in order
p = 0, 1, ... (mla_decode's merge sums a BLOCK_P-wide vector, whose reduction tree follows P). SGLang's deterministic
mode fixes the Triton decode's split size the same way, 256 keys (sgl-project/sglang python/sglang/srt/environ.py at
21ff4b08, SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import INDEX_DTYPES, require, require_tensor
from r3trace.kernels.flash import LOG2E
from r3trace.kernels.mla_decode.decode import check_decode_args
from r3trace.kernels.mla_decode.tile import MIN_TOKENS_PER_SPLIT
from r3trace.kernels.mla_decode.token_block import TokenBlockTile, token_block_stage1, token_block_tile

# Keys a split: the default policy's floor (tile.py MIN_TOKENS_PER_SPLIT: fewer and a split's fixed cost dominates).
# A 2k-key row is 8 splits at any batch.
SPLIT_KEYS = MIN_TOKENS_PER_SPLIT


@triton.jit
def _ordered_merge_kernel(
    # pointers
    part_out_ptr, part_lse_ptr, seq_lens_ptr, row_split_ptr, out_ptr,
    # sizes
    KV_LORA,
    # strides
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    # constexpr
    SPLIT: tl.constexpr, DYNAMIC: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    if DYNAMIC:  # noqa: SIM108 (a constexpr branch): the split size stage 1 cut this row's block at
        split = tl.load(row_split_ptr + b)
    else:
        split = SPLIT
    n_split = tl.cdiv(tl.load(seq_lens_ptr + b).to(tl.int32), split)  # this row's own splits
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < KV_LORA
    lse_row = part_lse_ptr + b * stride_lb + h * stride_lh
    m = float("-inf")
    for p in range(0, n_split):  # the max is exact in any order
        m = tl.maximum(m, tl.load(lse_row + p))
    acc = tl.zeros((BLOCK_C,), tl.float32)
    w_sum = 0.0
    part_row = part_out_ptr + b * stride_pb + h * stride_ph
    for p in range(0, n_split):  # p = 0, 1, ...: the one summation order
        w = tl.exp2(tl.load(lse_row + p) - m)
        acc += w * tl.load(part_row + p * stride_ps + offs_c, mask=c_mask, other=0.0)
        w_sum += w
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_c, (acc / w_sum).to(out_ptr.dtype.element_ty), mask=c_mask)


def check_block_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    q_start: torch.Tensor,
    q_lens: torch.Tensor,
    row_keys: torch.Tensor,
    kv_lora_rank: int,
) -> None:
    """check_decode_args with the rows as T (row_keys [T]) and the requests' tables [B] (pool, q_start, q_lens)."""
    check_decode_args(q, kv_cache, req_to_token, row_keys, row_keys, kv_lora_rank)
    for name, t in (("req_pool_indices", req_pool_indices), ("q_start", q_start), ("q_lens", q_lens)):
        require_tensor(name, t, 1, INDEX_DTYPES, q.device)
        require(t.shape == q_lens.shape, f"{name} has {t.shape[0]} rows, q_lens {q_lens.shape[0]}")


@dataclass(frozen=True)
class FixedSplitDecoder:
    """The batch-invariant attention for one head count and dtype: token_block.py's stage 1 (each program a block of
    one request's consecutive rows, cut at split_keys) and the ordered merge. Built once by the attention backend."""

    tile: TokenBlockTile
    split_keys: int = SPLIT_KEYS

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        q_start: torch.Tensor,
        q_lens: torch.Tensor,
        row_keys: torch.Tensor,
        kv_lora_rank: int,
        sm_scale: float,
        max_seq_len: int,
        max_q_len: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, C] -> [T, H, kv_lora]. Request b's rows are q_start[b] .. q_start[b] + q_lens[b] - 1 of T (a
        decode: one row; a verify or a prefill chunk: several), row t attends to positions 0 .. row_keys[t] - 1 of
        req_to_token row req_pool_indices[b]. max_seq_len, max_q_len: host bounds on row_keys and q_lens (they size
        the grid only, never a result). out: where to write (a view of a larger output), else a new tensor."""
        check_block_args(q, kv_cache, req_to_token, req_pool_indices, q_start, q_lens, row_keys, kv_lora_rank)
        require(self.split_keys % self.tile.block_n == 0,
                f"split_keys {self.split_keys} is not a multiple of the tile's {self.tile.block_n} keys")  # fmt: skip
        T, H, _ = q.shape
        if out is None:
            out = torch.empty((T, H, kv_lora_rank), dtype=q.dtype, device=q.device)
        require(tuple(out.shape) == (T, H, kv_lora_rank) and out.dtype == q.dtype,
                f"out is {tuple(out.shape)} {out.dtype}, expected {(T, H, kv_lora_rank)} {q.dtype}")
        if T == 0 or H == 0:
            return out
        splits = triton.cdiv(max(1, max_seq_len), self.split_keys)
        split_attention(q, kv_cache, req_to_token, req_pool_indices, q_start, q_lens, row_keys, kv_lora_rank,
                        sm_scale, self.tile, self.split_keys, splits, max_q_len, out, dynamic=False)  # fmt: skip
        return out


def split_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
    q_start: torch.Tensor, q_lens: torch.Tensor, row_keys: torch.Tensor, kv_lora_rank: int, sm_scale: float,
    tile: TokenBlockTile, split_keys: int, splits: int, max_q_len: int, out: torch.Tensor, dynamic: bool,
) -> None:  # fmt: skip
    """out [T, H, kv_lora] <- token_block.py's stage 1 into `splits` fp32 partials a row, then the ordered merge.
    dynamic: each block cuts its own split size on the device (>= split_keys keys), else every split is split_keys."""
    T, H, _ = q.shape
    part_out = torch.empty((T, H, splits, kv_lora_rank), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
    row_split = torch.empty((T,), dtype=torch.int32, device=q.device) if dynamic else None
    token_block_stage1(q, kv_cache, req_to_token, req_pool_indices, q_start, q_lens, row_keys, part_out, part_lse,
                       kv_lora_rank, sm_scale * LOG2E, tile, split_keys, max_q_len, row_split)  # fmt: skip
    ordered_merge(part_out, part_lse, row_keys, out, split_keys, row_split)


def ordered_merge(part_out: torch.Tensor, part_lse: torch.Tensor, row_keys: torch.Tensor, out: torch.Tensor,
                  split_keys: int, row_split: torch.Tensor | None = None) -> None:
    """out [T, H, kv_lora] <- row t's cdiv(row_keys[t], S) partials of part_out [T, H, P, kv_lora], weighted by
    part_lse [T, H, P], summed in order p = 0, 1, ...; S = split_keys, or row_split[t] (stage 1's dynamic splits)."""
    T, H, _, kv_lora_rank = part_out.shape
    _ordered_merge_kernel[(T, H)](
        part_out, part_lse, row_keys, row_split if row_split is not None else row_keys, out, kv_lora_rank,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        SPLIT=split_keys, DYNAMIC=row_split is not None, BLOCK_C=max(16, triton.next_power_of_2(kv_lora_rank)),
        num_warps=4,
    )  # fmt: skip


def row_chunks(q_lens: list[int], limit: int) -> list[tuple[int, int, int, int]]:
    """Requests of q_lens[b] rows each (consecutive in T) -> launches (b0, b1, r0, r1) of at most `limit` rows:
    requests b0 .. b1 - 1 whole, rows r0 .. r1 - 1 of T; a request of more rows alone, in pieces of `limit`
    (b1 = b0 + 1 and r1 - r0 below its rows). A row's bits do not depend on what else its launch holds."""
    limit = max(1, limit)
    out: list[tuple[int, int, int, int]] = []
    b0 = r0 = rows = 0
    for b, n in enumerate(q_lens):
        if rows and rows + n > limit:  # close the launch before b
            out.append((b0, b, r0, r0 + rows))
            b0, r0, rows = b, r0 + rows, 0
        if n > limit:  # alone, in pieces
            out += [(b, b + 1, r0 + i, r0 + min(n, i + limit)) for i in range(0, n, limit)]
            b0, r0 = b + 1, r0 + n
            continue
        rows += n
    if rows:
        out.append((b0, len(q_lens), r0, r0 + rows))
    return out


def fixed_split_decoder(num_heads: int, dtype: torch.dtype, split_keys: int = SPLIT_KEYS) -> FixedSplitDecoder:
    """token_block_tile's tile for these heads and dtype."""
    return FixedSplitDecoder(token_block_tile(num_heads, dtype), split_keys)
