"""The fused MoE's align-free decode path: two launches, no align, no y round trip, no sum launch.

Shapes as in kernels/fused_moe.py (T tokens, D hidden, I intermediate, K top-k, M = T*K pairs).

  gemv_gate_up:  program (pair, n tile): act[pair, n] = silu(x W_gate[e, n]^T) * (x W_up[e, n]^T),
                 e = topk_ids[pair], x = hidden[pair // K]; returns at once for e = -1 (row left unset).
  gemv_down_sum: program (t, n tile): out[t, n] = sum_k topk_weights[t, k] * act[t K + k] W2[e_k, n]^T,
                 the K experts of token t in one program (ids of -1 masked), fp32, rounded once.

At T = 1 (E = 256, I = 256, D = 7168) the grouped path's align, sum and two GEMMs over 8 16-row blocks give
64-128 programs streaming 88 MB; here 256-512 programs stream it and two of the four launches are gone.
Products are elementwise multiply-adds into [BLOCK_N, BLOCK_K] fp32 lanes (a row per pair: the tensor
cores would pad it to 16), reduced along K once after the loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from r3trace.kernels.moe_config import GemvTile


@triton.jit
def _gemv_gate_up_kernel(
    # pointers
    x_ptr, w_ptr, ids_ptr, act_ptr,
    # sizes
    N, KDIM,
    # strides
    stride_xt, stride_we, stride_wn, stride_am,
    # constexpr
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair)
    if expert < 0:  # expert on another rank: the act row stays unset, the down masks it out
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xt + offs_k
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            g = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            u = tl.load(w_ptrs + N * stride_wn, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + offs_k) < KDIM
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            g = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            u = tl.load(w_ptrs + N * stride_wn, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc_g += g.to(tl.float32) * x[None, :]
        acc_u += u.to(tl.float32) * x[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    act = gate * tl.sigmoid(gate) * up  # silu(gate) * up in fp32, one rounding (as the grouped path)
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_down_sum_kernel(
    # pointers
    act_ptr, w_ptr, ids_ptr, wts_ptr, out_ptr,
    # sizes
    N, KDIM,
    # strides
    stride_am, stride_we, stride_wn, stride_ot,
    # constexpr
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k in tl.static_range(TOP_K):  # unrolled: every expert's loads can be in flight together
        pair = t * TOP_K + k
        expert = tl.load(ids_ptr + pair)
        wt = tl.load(wts_ptr + pair)
        w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we + w_rows
        a_base = act_ptr + pair.to(tl.int64) * stride_am
        for k0 in range(0, KDIM, BLOCK_K):
            kk = k0 + offs_k
            k_mask = (kk < KDIM) & ((kk * 0 + expert) >= 0)  # id -1: masked loads, no traffic, adds zeros
            a = tl.load(a_base + kk, mask=k_mask, other=0.0).to(tl.float32) * wt
            w = tl.load(w_base + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32) * a[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv_gate_up(hidden: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, tile: GemvTile) -> torch.Tensor:
    """hidden [T, D] -> act [T K, I] (rows of pairs with id -1 unset); arguments checked by fused_moe."""
    T, D = hidden.shape
    K = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    act = torch.empty((T * K, inter), dtype=hidden.dtype, device=hidden.device)
    block_k = min(tile.up_k, triton.next_power_of_2(D))
    _gemv_gate_up_kernel[(T * K, triton.cdiv(inter, tile.up_n))](
        hidden, w13, topk_ids, act, inter, D,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=K, BLOCK_N=tile.up_n, BLOCK_K=block_k, EVEN_K=D % block_k == 0,
        num_warps=tile.up_warps, num_stages=tile.up_stages,
    )  # fmt: skip
    return act


def gemv_down_sum(
    act: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, tile: GemvTile
) -> torch.Tensor:
    """act [T K, I] -> out [T, D] = sum over k of topk_weight * act W2^T, ids of -1 contributing nothing."""
    T, K = topk_ids.shape
    D, inter = w2.shape[1], w2.shape[2]
    out = torch.empty((T, D), dtype=act.dtype, device=act.device)
    _gemv_down_sum_kernel[(T, triton.cdiv(D, tile.down_n))](
        act, w2, topk_ids, topk_weights, out, D, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=K, BLOCK_N=tile.down_n, BLOCK_K=min(tile.down_k, triton.next_power_of_2(inter)),
        num_warps=tile.down_warps, num_stages=tile.down_stages,
    )  # fmt: skip
    return out
