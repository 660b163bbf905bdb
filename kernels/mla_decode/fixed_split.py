"""Batch-invariant MLA decode (EngineConfig.batch_invariant): fixed-size KV splits merged in a fixed order, so a
query row's output depends on its own key count and keys only, not on the batch, the grid or the SM count.

Shape legend as in decode.py: B query rows (a decode's requests, or every row of a verify or prefill chunk, each with
its own key count), H heads, C = kv_lora + rope, P splits.

Why: mla_decode picks its split count P from the batch size, the longest row and the SM count (tile.py), and a row's
keys are cut into P runs of cdiv(seq_len, P) keys: the same request reads its keys in a different order at batch 1
and at batch 32, and a verify's rows went through the extend kernel, whose tiles differ again. Here split p of a row
always covers positions [p * SPLIT_KEYS, (p + 1) * SPLIT_KEYS) (the Triton stage 1 with FIXED_SPLIT), the grid's P
only bounds the longest row (splits past a row's length return at once), and the merge walks the row's
cdiv(seq_len, SPLIT_KEYS) partials in order p = 0, 1, ... (mla_decode's merge sums a BLOCK_P-wide vector, whose
reduction tree follows P). SGLang's deterministic mode fixes the Triton decode's split size the same way, 256 keys
(sgl-project/sglang python/sglang/srt/environ.py at 21ff4b08, SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import require
from r3trace.kernels.flash import LOG2E
from r3trace.kernels.mla_decode.decode import check_decode_args
from r3trace.kernels.mla_decode.tile import MIN_TOKENS_PER_SPLIT, DecodeTile, default_decode_tile
from r3trace.kernels.mla_decode.triton_stage1 import mla_decode_stage1_triton

# Keys a split: the default policy's floor (tile.py MIN_TOKENS_PER_SPLIT: fewer and a split's fixed cost dominates).
# A 2k-key row is 8 splits at any batch.
SPLIT_KEYS = MIN_TOKENS_PER_SPLIT


@triton.jit
def _ordered_merge_kernel(
    # pointers
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
    # sizes
    KV_LORA,
    # strides
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    # constexpr
    SPLIT: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_split = tl.cdiv(tl.load(seq_lens_ptr + b).to(tl.int32), SPLIT)  # this row's own splits
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


@dataclass(frozen=True)
class FixedSplitDecoder:
    """The batch-invariant decode for one head count and dtype: the Triton stage 1 with `tile` (default_decode_tile's
    Triton tile) cut at split_keys, then the ordered merge. Built once by the attention backend."""

    tile: DecodeTile
    split_keys: int = SPLIT_KEYS

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_lora_rank: int,
        sm_scale: float,
        max_seq_len: int,
    ) -> torch.Tensor:
        """q [B, H, C] -> [B, H, kv_lora]; row b attends to positions 0..seq_lens[b]-1 of req_to_token row
        req_pool_indices[b]. max_seq_len: a host bound on seq_lens (it sizes the grid only, never the result)."""
        check_decode_args(q, kv_cache, req_to_token, req_pool_indices, seq_lens, kv_lora_rank)
        require(self.split_keys % self.tile.block_n == 0,
                f"split_keys {self.split_keys} is not a multiple of the tile's {self.tile.block_n} keys")  # fmt: skip
        B, H, _ = q.shape
        out = torch.empty((B, H, kv_lora_rank), dtype=q.dtype, device=q.device)
        if B == 0 or H == 0:
            return out
        splits = triton.cdiv(max(1, max_seq_len), self.split_keys)
        part_out = torch.empty((B, H, splits, kv_lora_rank), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
        mla_decode_stage1_triton(q, kv_cache, req_to_token, req_pool_indices, seq_lens, part_out, part_lse,
                                 kv_lora_rank, sm_scale * LOG2E, self.tile, fixed_split=self.split_keys)  # fmt: skip
        _ordered_merge_kernel[(B, H)](
            part_out, part_lse, seq_lens, out, kv_lora_rank,
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            SPLIT=self.split_keys, BLOCK_C=max(16, triton.next_power_of_2(kv_lora_rank)), num_warps=4,
        )  # fmt: skip
        return out


def fixed_split_decoder(num_heads: int, dtype: torch.dtype, split_keys: int = SPLIT_KEYS) -> FixedSplitDecoder:
    """The Triton tile default_decode_tile gives these heads and dtype (never a Gluon one: only the Triton stage 1 has
    the fixed-split form), with PDL off (the stage 1 and the merge launch plainly)."""
    tile = default_decode_tile(num_heads, dtype, use_gluon=False)._replace(pdl=False)
    return FixedSplitDecoder(tile, split_keys)
