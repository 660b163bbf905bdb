"""The decode's stage 2: each (request, head) merges its P split partials by their log-sum-exps.

Shapes as in decode.py: part_out [B, H, P, kv_lora] fp32 (each split normalised by its own sum), part_lse [B, H, P]
(log2 units), out [B, H, kv_lora]. A split whose start is past the request's length wrote nothing and weighs nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _mla_decode_merge_kernel(
    # pointers
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
    # sizes
    KV_LORA, num_kv_splits, split_align,
    # strides
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    # constexpr
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched while stage 1 may still run: its partials are complete and visible after the wait
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), split_align) * split_align
    offs_p = tl.arange(0, BLOCK_P)
    offs_c = tl.arange(0, BLOCK_C)
    # the same split ranges as stage 1: a split whose start is past seq_len wrote nothing
    p_mask = (offs_p < num_kv_splits) & (offs_p * split_len < seq_len)
    c_mask = offs_c < KV_LORA
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_p, mask=p_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    w = tl.where(p_mask, w, 0.0)
    part = part_out_ptr + b * stride_pb + h * stride_ph + offs_p[:, None] * stride_ps + offs_c[None, :]
    o = tl.load(part, mask=p_mask[:, None] & c_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_mask)


def merge_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, split_align: int,
    pdl: bool = False,
) -> None:  # fmt: skip
    """out [B, H, kv_lora] <- the LSE-weighted sum of part_out's P splits; split_align: stage 1's tile (each split a
    whole number of them); pdl: launched as a programmatic dependent of stage 1 (sm_90+)."""
    B, H, num_kv_splits, kv_lora = part_out.shape
    _mla_decode_merge_kernel[(B, H)](
        part_out, part_lse, seq_lens, out,
        kv_lora, num_kv_splits, split_align,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_P=max(2, triton.next_power_of_2(num_kv_splits)), BLOCK_C=max(16, triton.next_power_of_2(kv_lora)),
        PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
