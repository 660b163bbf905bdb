"""Fused MoE: align token-expert pairs by expert, grouped GEMMs for gate_up (+SiLU-and-mul) and down.

Shape legend: T tokens, D hidden, E local experts, I moe_intermediate_size, K top-k, M = T*K pairs.

    hidden [T, D]; w13 [E, 2I, D] (rows 0..I-1 gate_proj, I..2I-1 up_proj); w2 [E, D, I]
    topk_ids [T, K] int32 (-1: expert not on this rank, skipped); topk_weights [T, K] fp32
    out [T, D] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)),
                 e = topk_ids[t, k]

Pipeline (SGLang's fused_moe layout, four launches, no host sync, so it can sit inside a CUDA graph):
  1. moe_align: pair indices sorted by expert, each expert's run padded to BLOCK_M with the sentinel M,
     and the expert of every BLOCK_M block (-1 past the end). Each GEMM block then has one expert.
  2. _fused_moe_kernel GATE_UP: act [M, I] = silu(x W_gate^T) * (x W_up^T), both products in one program
     (the A tile is loaded once for both), written in the activation dtype.
  3. _fused_moe_kernel DOWN: y [M, D] = topk_weight * (act W2^T).
  4. _moe_sum_kernel: out [T, D] = sum over k of y, fp32 accumulation, skipping ids of -1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import FLOAT_DTYPES, require, require_tensor
from r3trace.kernels.dot import dot_precision, mma


class MoeAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # [P] int32, pair index t*K+k, grouped by expert; padding = M
    block_expert: torch.Tensor  # [P / block_m] int32, expert of each block; -1 past the last block
    num_padded: torch.Tensor  # [1] int32, P actually used (on the device: no host sync)


class MoeConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # blocks of M walked together so their weight tiles stay in L2
    num_warps: int
    num_stages: int


def moe_config(num_pairs: int, num_experts: int, itemsize: int = 2) -> MoeConfig:
    """Tile by the mean rows per expert: decode-sized runs want BLOCK_M 16 (the tensor cores' minimum)
    and many programs over N; prefill-sized runs want 128x128 tiles for arithmetic intensity.

    fp32 halves BLOCK_K: the gate_up kernel stages an A tile and two B tiles per pipeline stage, and
    at 4 bytes (16, 64, 128) x 4 stages needs 295 KB of shared memory, over the H200's 227 KB
    (seen on the H200: OutOfResources, required 245760)."""
    rows = num_pairs / max(1, num_experts)
    if rows <= 16:
        cfg = MoeConfig(16, 64, 128, 1, 4, 4)
    elif rows <= 64:
        cfg = MoeConfig(32, 64, 128, 4, 4, 4)
    elif rows <= 256:
        cfg = MoeConfig(64, 128, 64, 8, 4, 4)
    else:
        cfg = MoeConfig(128, 128, 64, 8, 8, 3)
    return cfg._replace(block_k=cfg.block_k // 2) if itemsize >= 4 else cfg


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids [T, K] -> pairs sorted by expert, each expert padded to a multiple of block_m.

    All device ops with static output sizes: P = M + min(E, M) * (block_m - 1) rounded up to block_m
    bounds sum_e ceil(count_e / block_m) * block_m.
    """
    require_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64), topk_ids.device)
    require(block_m >= 1, f"block_m {block_m} must be >= 1")
    require(num_experts >= 1, f"num_experts {num_experts} must be >= 1")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [M]
    M = flat.numel()
    cap = triton.cdiv(M + min(num_experts, M) * (block_m - 1), block_m) * block_m
    key = torch.where(flat >= 0, flat, num_experts)  # [M], skipped pairs go to a last bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(
        0, key, torch.ones_like(key)
    )  # [E+1]
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    pad_end = padded.cumsum(0)  # [E]
    pad_start = pad_end - padded  # [E]
    order = torch.argsort(key, stable=True)  # [M] pair indices grouped by expert
    sorted_key = key[order]  # [M]
    count_start = counts.cumsum(0) - counts  # [E+1]
    rank = torch.arange(M, device=dev) - count_start[sorted_key]  # [M] rank within its expert
    dest = torch.where(
        sorted_key < num_experts, pad_start[sorted_key.clamp(max=num_experts - 1)] + rank, cap
    )  # [M], skipped pairs land in a dump slot past the end
    sorted_ids = torch.full((cap + 1,), M, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, cap, block_m, device=dev)  # [P / block_m]
    block_expert = torch.searchsorted(pad_end, block_starts, right=True)  # [P / block_m]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    num_padded = pad_end[-1:].to(torch.int32)  # [1]
    return MoeAlignment(sorted_ids[:cap], block_expert, num_padded)


@triton.jit
def _fused_moe_kernel(
    # pointers
    a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_weights_ptr,
    # sizes
    N, KDIM, num_pairs, cap, a_row_div,
    # strides
    stride_am, stride_we, stride_wn, stride_om,
    # constexpr
    GATE_UP: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # GATE_UP: out[pair, n] = silu(a W[n]) * (a W[N + n]), a = hidden[pair // K]   (N = I, KDIM = D)
    # DOWN:    out[pair, n] = topk_weight[pair] * (a W[n]), a = act[pair]         (N = D, KDIM = I)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(cap, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    pair_mask = pairs < num_pairs
    a_rows = (pairs // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=pair_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + offs_k) < KDIM
            a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += mma(a, w, UPCAST, INPUT_PRECISION)
        if GATE_UP:
            if EVEN_K:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=n_mask[None, :], other=0.0)
            else:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up += mma(a, w_up, UPCAST, INPUT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if GATE_UP:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up, in fp32 before the one rounding
    else:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)[:, None]
    o_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_sum_kernel(
    # pointers
    y_ptr, ids_ptr, out_ptr,
    # sizes
    D,
    # strides
    stride_ym, stride_it, stride_ot,
    # constexpr
    TOP_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + t * stride_it + k)
        on_rank = d_mask & ((offs_d * 0 + expert) >= 0)  # rows of skipped pairs (-1) were never written
        row = (t * TOP_K + k).to(tl.int64)
        acc += tl.load(y_ptr + row * stride_ym + offs_d, mask=on_rank, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


def _check_moe_args(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> None:
    dev = hidden.device
    require_tensor("hidden", hidden, 2, FLOAT_DTYPES, dev)
    require_tensor("w13", w13, 3, (hidden.dtype,), dev)
    require_tensor("w2", w2, 3, (hidden.dtype,), dev)
    require_tensor("topk_ids", topk_ids, 2, (torch.int32,), dev)
    require_tensor("topk_weights", topk_weights, 2, (torch.float32,), dev)
    T, D = hidden.shape
    E, two_i, d13 = w13.shape
    require(d13 == D and two_i % 2 == 0, f"w13 shape {tuple(w13.shape)} is not [E, 2I, D={D}]")
    I = two_i // 2
    require(tuple(w2.shape) == (E, D, I), f"w2 shape {tuple(w2.shape)} is not [E={E}, D={D}, I={I}]")
    require(w13.is_contiguous() and w2.is_contiguous(), "w13 and w2 must be contiguous")
    require(topk_ids.shape[0] == T, f"topk_ids has {topk_ids.shape[0]} rows, hidden has T={T}")
    require(
        topk_weights.shape == topk_ids.shape,
        f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}",
    )
    require(topk_ids.is_contiguous() and topk_weights.is_contiguous(), "topk_ids/weights: not contiguous")


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """hidden [T, D] -> [T, D]; see the module docstring. config=None picks tiles by rows per expert."""
    _check_moe_args(hidden, w13, w2, topk_ids, topk_weights)
    T, D = hidden.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    K = topk_ids.shape[1]
    M = T * K
    out = torch.empty((T, D), dtype=hidden.dtype, device=hidden.device)
    if M == 0:
        return out
    cfg = config or moe_config(M, E, hidden.element_size())
    align = moe_align(topk_ids, E, cfg.block_m)
    cap = align.sorted_ids.shape[0]
    act = torch.empty((M, I), dtype=hidden.dtype, device=hidden.device)
    y = torch.empty((M, D), dtype=hidden.dtype, device=hidden.device)
    precision = dot_precision(hidden.dtype == torch.float32)
    common = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        UPCAST=not hidden.is_cuda, INPUT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    blocks_m = cap // cfg.block_m
    _fused_moe_kernel[(blocks_m * triton.cdiv(I, cfg.block_n),)](
        hidden, w13, act, align.sorted_ids, align.block_expert, align.num_padded, topk_weights,
        I, D, M, cap, K,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        GATE_UP=True, EVEN_K=D % cfg.block_k == 0, **common,
    )  # fmt: skip
    _fused_moe_kernel[(blocks_m * triton.cdiv(D, cfg.block_n),)](
        act, w2, y, align.sorted_ids, align.block_expert, align.num_padded, topk_weights,
        D, I, M, cap, 1,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        GATE_UP=False, EVEN_K=I % cfg.block_k == 0, **common,
    )  # fmt: skip
    block_d = 1024
    _moe_sum_kernel[(T, triton.cdiv(D, block_d))](
        y, topk_ids, out, D, y.stride(0), topk_ids.stride(0), out.stride(0),
        TOP_K=K, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


def fused_moe_ref(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Per-expert loop in torch (the engine's reference MoE, and bench's baseline); fp32 accumulation."""
    _check_moe_args(hidden, w13, w2, topk_ids, topk_weights)
    I = w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, D]
    for e in range(w13.shape[0]):
        rows, ks = torch.where(topk_ids == e)  # [n], [n]
        if rows.numel() == 0:
            continue
        gate_up = hidden[rows] @ w13[e].T  # [n, 2I]
        act = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]  # [n, I]
        y = (act @ w2[e].T).float() * topk_weights[rows, ks, None]  # [n, D]
        out.index_add_(0, rows, y)
    return out.to(hidden.dtype)
