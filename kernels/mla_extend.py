"""Extend attention in the absorbed MLA form over the paged cache (the normal MHA form: mha_prefill.py).

Shape legend: T new tokens (all requests), B requests, H heads, C = kv_lora + rope, S cache slots.

mla_extend (absorbed): the new tokens' latents are already in kv_cache, so request b's token i, at
position p = prefix_lens[b] + i, attends to positions 0..p (causal, inclusive), all gathered from the
cache through req_to_token (any page size). Same math as mla_decode, with BLOCK_M query tokens of one
head per program instead of one token: q [T, H, C] -> out [T, H, kv_lora].

Program (b, block of BLOCK_M tokens, head), online softmax in fp32 (exp2, the scale folded into log2
units), keys walked only up to the last query row of the block (the causal bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import FLOAT_DTYPES, INDEX_DTYPES, grid_len, require, require_tensor
from r3trace.kernels.dot import dot_precision
from r3trace.kernels.flash import LOG2E, latent_tile_scores, online_softmax_step
from r3trace.kernels.mha_prefill import mha_prefill, mha_prefill_ref  # re-exported: see __all__
from r3trace.kernels.mla_decode.reference import latent_attention_ref

# issue 6 names this module for both forms; the normal (prefix-free MHA) one lives in mha_prefill.py
__all__ = ["mha_prefill", "mha_prefill_ref", "mla_extend", "mla_extend_ref"]


@triton.jit
def _mla_extend_kernel(
    # pointers
    q_ptr, kv_ptr, out_ptr, req_to_token_ptr, req_pool_ptr, prefix_lens_ptr, extend_lens_ptr, start_loc_ptr,
    # sizes
    KV_LORA, ROPE, qk_scale,
    # strides
    stride_qt, stride_qh, stride_kvs, stride_ot, stride_oh, stride_rtr,
    # constexpr
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    mb = tl.program_id(1)
    h = tl.program_id(2)
    ext = tl.load(extend_lens_ptr + b).to(tl.int32)
    if mb * BLOCK_M >= ext:
        return
    prefix = tl.load(prefix_lens_ptr + b).to(tl.int32)
    start_loc = tl.load(start_loc_ptr + b).to(tl.int64)
    req_row = tl.load(req_pool_ptr + b).to(tl.int64)

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < ext
    c_mask = offs_c < KV_LORA
    r_mask = offs_r < ROPE
    # rows past ext get positions past seq_len: they see every key, so no all-masked row, never stored
    pos_q = prefix + offs_m
    q_rows = q_ptr + (start_loc + offs_m)[:, None] * stride_qt + h * stride_qh
    q_nope = tl.load(q_rows + offs_c[None, :], mask=m_mask[:, None] & c_mask[None, :], other=0.0)
    q_pe = tl.load(q_rows + KV_LORA + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_C), tl.float32)
    kv_end = prefix + tl.minimum((mb + 1) * BLOCK_M, ext)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        qk, kv = latent_tile_scores(
            q_nope, q_pe, kv_ptr, req_to_token_ptr, req_row, offs_n, n_mask, offs_c, c_mask, offs_r, r_mask,
            stride_kvs, stride_rtr, KV_LORA, UPCAST, INPUT_PRECISION,
        )
        visible = n_mask[None, :] & (offs_n[None, :] <= pos_q[:, None])
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, kv, m_i, l_i, acc, UPCAST, INPUT_PRECISION)

    out = acc / l_i[:, None]
    o_rows = out_ptr + (start_loc + offs_m)[:, None] * stride_ot + h * stride_oh
    o_mask = m_mask[:, None] & c_mask[None, :]
    tl.store(o_rows + offs_c[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)


def _check_extend_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    kv_lora_rank: int,
) -> None:
    dev = q.device
    require_tensor("q", q, 3, FLOAT_DTYPES, dev)
    require_tensor("kv_cache", kv_cache, 2, (q.dtype,), dev)
    require_tensor("req_to_token", req_to_token, 2, INDEX_DTYPES, dev)
    B = req_pool_indices.shape[0]
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens),
                    ("extend_lens", extend_lens), ("extend_start_loc", extend_start_loc)):  # fmt: skip
        require_tensor(name, t, 1, INDEX_DTYPES, dev)
        require(t.shape[0] == B, f"{name} has {t.shape[0]} rows, req_pool_indices has B={B}")
    C = q.shape[2]
    require(kv_cache.shape[1] == C, f"kv_cache row has {kv_cache.shape[1]} columns, q has C={C}")
    require(0 < kv_lora_rank < C, f"kv_lora_rank {kv_lora_rank} must be in 1..C-1={C - 1}")


def mla_extend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """q: [T, H, C] -> [T, H, kv_lora]; causal over the cached prefix plus the new tokens (all in the cache).

    max_extend_len: the grid bound; None reads max(extend_lens) from the device (one sync).
    """
    _check_extend_args(
        q, kv_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc, kv_lora_rank
    )
    T, H, C = q.shape
    out = torch.empty((T, H, kv_lora_rank), dtype=q.dtype, device=q.device)
    B = req_pool_indices.shape[0]
    max_len = grid_len(extend_lens, max_extend_len)
    if T == 0 or B == 0 or max_len == 0:
        return out
    block_m, block_n = 32, 32  # acc [32, 512] fp32 over 8 warps: 64 registers a thread
    grid = (B, triton.cdiv(max_len, block_m), H)
    _mla_extend_kernel[grid](
        q, kv_cache, out, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc,
        kv_lora_rank, C - kv_lora_rank, sm_scale * LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), out.stride(0), out.stride(1), req_to_token.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_C=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_R=max(16, triton.next_power_of_2(C - kv_lora_rank)),
        UPCAST=not q.is_cuda, INPUT_PRECISION=dot_precision(q.dtype == torch.float32),
        num_warps=8, num_stages=2,
    )  # fmt: skip
    return out


def mla_extend_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    max_extend_len: int | None = None,
) -> torch.Tensor:
    """Same contract as mla_extend: per request, its prefix + extend rows gathered through req_to_token and the MLA
    decode's reference attention (latent_attention_ref: causal, fp32) over them."""
    _check_extend_args(
        q, kv_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start_loc, kv_lora_rank
    )
    T, H, _ = q.shape
    out = torch.empty((T, H, kv_lora_rank), dtype=q.dtype, device=q.device)
    for b in range(req_pool_indices.shape[0]):
        prefix, ext, s0 = int(prefix_lens[b]), int(extend_lens[b]), int(extend_start_loc[b])
        if ext == 0:
            continue
        slots = req_to_token[int(req_pool_indices[b]), : prefix + ext].long()  # [n]
        out[s0 : s0 + ext] = latent_attention_ref(q[s0 : s0 + ext], kv_cache[slots], kv_lora_rank, sm_scale).to(q.dtype)
    return out
