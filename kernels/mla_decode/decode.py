"""MLA decode attention over the paged latent KV cache: flash decoding in two launches.

Shape legend: B requests (one new token each), H query heads, C = kv_lora + rope (one cache row),
S cache slots, R request rows of req_to_token, P = num_kv_splits.

    q        [B, H, C]   absorbed queries: [q_nope @ w_kc (kv_lora), q_pe roped (rope)]
    kv_cache [S, C]      row = [c_kv (kv_lora, normed), k_pe (rope, roped)]; V = c_kv
    out      [B, H, kv_lora]

Stage 1 (mla_decode_triton.py): program (b, head block, split) walks its split of positions
0..seq_len-1 in tiles of BLOCK_N keys, gathering slots through req_to_token (any page size), and keeps
an online softmax for BLOCK_H heads at once: one latent tile loaded from HBM serves BLOCK_H query heads
(SGLang's grouped decode kernel uses 16), which is what makes MLA decode memory-bound rather than
re-reading the cache per head. It writes the split's normalised partial output and its log-sum-exp.
Stage 2 (`_mla_decode_merge_kernel`): program (b, h) merges the P partials by their LSE weights. A split covers a
whole number of BLOCK_N tiles (all but a request's last split), so no program pays for a partly empty tile mid-
request. decode_tile.py holds the tiles and split counts (re-exported here); DecodeTile(kernel="gluon") runs stage
1 as mla_decode_gluon.py's kernel (H >= 64 on Hopper; the same partials, the same merge), kernel="narrow" as
mla_decode_narrow.py's (16-head blocks on Hopper, keys-major wgmma; TMA tiles on pages of a multiple of 64 slots,
else cp.async row copies), kernel="seesaw" as mla_decode_seesaw.py's (H >= 64 on Hopper, TMA tiles only, rope 64: the
two warpgroups take alternate tiles and pass the row max and P between them). DecodeTile.pdl launches the Triton
stage 1 and the merge as programmatic dependents (sm_90+): each waits (griddepcontrol.wait) before its first global
access. DecodeTile.cluster lets a Gluon stage 1
merge its splits inside thread-block clusters (cluster_merge.py): no partials and no stage 2 where they fit.
"""

from __future__ import annotations

import functools
import importlib

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from r3trace.kernels.contract import FLOAT_DTYPES, INDEX_DTYPES, require, require_tensor
from r3trace.kernels.mla_decode.tile import CLUSTER_SIZES, DecodeTile, choose_num_kv_splits, default_decode_tile

__all__ = ["DecodeTile", "choose_num_kv_splits", "default_decode_tile", "mla_decode", "mla_decode_ref"]
from r3trace.kernels.flash import LOG2E
from r3trace.kernels.mla_decode.triton_stage1 import mla_decode_stage1_triton

# DecodeTile.kernel: the Triton stage 1 (mla_decode_triton.py), or a Gluon one: (module, its support check, its
# stage-1 launcher), looked up by name at each call
GLUON_STAGE1 = {
    "gluon": ("wide", "gluon_supported", "mla_decode_stage1_gluon"),
    "narrow": ("narrow", "narrow_supported", "mla_decode_stage1_narrow"),
    "seesaw": ("seesaw", "seesaw_supported", "mla_decode_stage1_seesaw"),
}
KERNELS = ("triton", *GLUON_STAGE1)


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


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=8)
def _has_pdl(device_index: int) -> bool:
    """griddepcontrol (programmatic dependent launch) needs sm_90+."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _check_decode_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
) -> None:
    dev = q.device
    require_tensor("q", q, 3, FLOAT_DTYPES, dev)
    require_tensor("kv_cache", kv_cache, 2, (q.dtype,), dev)
    require_tensor("req_to_token", req_to_token, 2, INDEX_DTYPES, dev)
    require_tensor("req_pool_indices", req_pool_indices, 1, INDEX_DTYPES, dev)
    require_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES, dev)
    B, _, C = q.shape
    require(kv_cache.shape[1] == C, f"kv_cache row has {kv_cache.shape[1]} columns, q has C={C}")
    require(0 < kv_lora_rank < C, f"kv_lora_rank {kv_lora_rank} must be in 1..C-1={C - 1}")
    require(q.stride(2) == 1, f"q must be contiguous in C, strides {q.stride()}")
    require(req_pool_indices.shape[0] == B, f"req_pool_indices has {req_pool_indices.shape[0]} rows, B={B}")
    require(seq_lens.shape[0] == B, f"seq_lens has {seq_lens.shape[0]} rows, B={B}")


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    num_kv_splits: int | None = None,
    tile: DecodeTile | None = None,
) -> torch.Tensor:
    """q: [B, H, C] -> out [B, H, kv_lora]; request b attends to positions 0..seq_lens[b]-1.

    num_kv_splits=None picks it from max(seq_lens) (one device sync) and the SM count; pass it (see
    choose_num_kv_splits) to stay sync-free and CUDA-graph capturable. tile=None: default_decode_tile
    without Gluon (bench/kernels.py sweeps others; the engine's backend asks for Gluon on Hopper).
    """
    _check_decode_args(q, kv_cache, req_to_token, req_pool_indices, seq_lens, kv_lora_rank)
    B, H, C = q.shape
    tile = tile or default_decode_tile(H, q.dtype)
    require(tile.v_splits in (1, 2), f"v_splits {tile.v_splits} not in (1, 2)")
    require(tile.kernel in KERNELS, f"kernel {tile.kernel!r} not in {KERNELS}")
    rope = C - kv_lora_rank
    if num_kv_splits is None:
        max_len = int(seq_lens.max().item()) if B > 0 else 1
        sms = _sm_count(q.device.index or 0) if q.is_cuda else 4  # interpret: a few splits, still > 1
        num_kv_splits = tile.num_kv_splits(B, H, max_len, sms)
    require(1 <= num_kv_splits <= 1024, f"num_kv_splits {num_kv_splits} not in 1..1024")
    out = torch.empty((B, H, kv_lora_rank), dtype=q.dtype, device=q.device)
    if B == 0 or H == 0:
        return out
    # One split: stage 1's normalised tile is the answer. It is stored straight into out (rounded once, as the
    # merge would: its weight is exp2(0) = 1, so the bits are the same) and stage 2 is skipped. At H = 128,
    # B = 256 that merge cost 0.027 ms of a 0.234 ms call (bench/NOTES.md "mla128, session 4", run 3), plus
    # stage 1's 67 MB of fp32 partials; splits_by_cost picks one split at B >= 64 there. Opt-in per tile
    # (DecodeTile.direct; the Gluon default has it): the H = 16 Triton tile measured 2% slower with it.
    direct = num_kv_splits == 1 and tile.direct
    pdl = tile.pdl and q.is_cuda and _has_pdl(q.device.index or 0)  # interpret: no griddepcontrol
    block_c = max(16, triton.next_power_of_2(kv_lora_rank))
    block_r = max(16, triton.next_power_of_2(rope))
    require(block_c // tile.v_splits >= 16, f"kv_lora {kv_lora_rank} too small for {tile.v_splits} value splits")
    stage1 = None
    if tile.kernel in GLUON_STAGE1:
        name, check, launch = GLUON_STAGE1[tile.kernel]
        gk = importlib.import_module(f"r3trace.kernels.mla_decode.{name}")  # imports Gluon only when asked for
        why = getattr(gk, check)(q, kv_lora_rank)
        require(why is None, str(why))
        fixed = (gk.BLOCK_H, gk.BLOCK_N, gk.NUM_WARPS, 2, 1)
        require(tile[:5] == fixed and not tile.keys_major,
                f"the {tile.kernel} Gluon kernel's tile is fixed: {fixed[0]} heads x {fixed[1]} keys x {fixed[2]} "
                f"warps, 2 stages; got {tile}")  # fmt: skip
        stage1 = functools.partial(getattr(gk, launch), q, kv_cache, req_to_token, req_pool_indices, seq_lens)
        args = (kv_lora_rank, sm_scale * LOG2E, tile.block_n, tile.page_size)
        # the splits merged inside thread-block clusters (cluster_merge.py): stage 1 stores the output as in
        # `direct`; the launcher declines (False) where the clusters would not all fit on the GPU at once
        if num_kv_splits in CLUSTER_SIZES and num_kv_splits <= tile.cluster and stage1(
            out.unsqueeze(2), out, *args, pdl=pdl, cluster=num_kv_splits
        ):
            return out
    part_out = out.unsqueeze(2) if direct else torch.empty(
        (B, H, num_kv_splits, kv_lora_rank), dtype=torch.float32, device=q.device)  # fmt: skip
    part_lse = torch.empty((B, H, num_kv_splits), dtype=torch.float32, device=q.device)  # direct: unread
    if stage1 is not None:
        stage1(part_out, part_lse, *args, pdl=pdl)
    else:
        mla_decode_stage1_triton(q, kv_cache, req_to_token, req_pool_indices, seq_lens, part_out, part_lse,
                                 kv_lora_rank, sm_scale * LOG2E, tile, block_c, block_r, pdl)  # fmt: skip
    if direct:
        return out
    _mla_decode_merge_kernel[(B, H)](
        part_out, part_lse, seq_lens, out,
        kv_lora_rank, num_kv_splits, tile.block_n,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_P=max(2, triton.next_power_of_2(num_kv_splits)), BLOCK_C=block_c, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
    return out




def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Per-request gather + softmax in fp32; num_kv_splits is accepted and ignored (same signature)."""
    _check_decode_args(q, kv_cache, req_to_token, req_pool_indices, seq_lens, kv_lora_rank)
    B, H, _ = q.shape
    out = torch.empty((B, H, kv_lora_rank), dtype=q.dtype, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), :n].long()  # [n]
        kv = kv_cache[slots].float()  # [n, C]
        scores = (q[b].float() @ kv.T) * sm_scale  # [H, n]
        out[b] = (scores.softmax(dim=-1) @ kv[:, :kv_lora_rank]).to(q.dtype)  # [H, kv_lora]
    return out
