"""The fused MoE's align-free decode path: two launches, no align, no y round trip, no sum launch.

Shapes as in fused_moe.py (T tokens, D hidden, I intermediate, K top-k, M = T*K pairs).

  gemv_gate_up:  program (pair, n tile): act[pair, n] = silu(x W_gate[e, n]^T) * (x W_up[e, n]^T),
                 e = topk_ids[pair], x = hidden[pair // K]; returns at once for e = -1 (row left unset).
  gemv_down_sum: program (t, n tile): out[t, n] = sum_k topk_weights[t, k] * act[t K + k] W2[e_k, n]^T,
                 the K experts of token t in one program (ids of -1 masked), fp32, rounded once.

When it runs: moe_config picks it at T = 1 (any I) and T <= 4 at I <= 256 (config.py). At T = 1 (E = 256, I = 256,
D = 7168) the grouped path's align, sum and two GEMMs over 8 16-row blocks give 64-128 programs streaming 88 MB; here
1792-2048 programs stream it and two of the four launches are gone: 0.036 vs 0.052 ms a call (H200,
BENCHMARKS.md#fused-moe). Products are elementwise multiply-adds into [BLOCK_N, BLOCK_K] fp32 lanes (a row per pair:
the tensor cores would pad it to 16), reduced along K once at the end. These loads feed no dot, so Triton would not
pipeline a runtime loop over them (each step would wait out a memory latency): D and I are compile-time sizes
(KDIM_UNROLL), the K steps unrolled, each step's loads issued before the previous step's products (up 0.0275 ->
0.0243 ms, down 0.0184 -> 0.0161 at T = 1 against the runtime loops).

The tiles' `up_evict_first` / `down_evict_first` hint the weight loads evict_first in the L2: each weight line is read
once, so it should make way before lines someone may read again. When the L2 holds dirty lines, unhinted weights
displace them and pay their write-back; hinted ones displace each other: E = 256, T = 1, 0.0364 -> 0.0320 ms with the
L2 dirty, 0.0289 -> 0.0285 clean.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from r3trace.kernels.moe.config import GemvTile

UNROLLED_STAGES = 1  # every K step is unrolled at compile time: no loop for the software pipeliner


@triton.jit
def _lanes_load(x_ptrs, w_ptrs, up_off, k0, offs_k, n_mask, KDIM, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    """One D step of the gate_up: x [BK] fp32, gate and up weight tiles [BN, BK] (masked past D and N)."""
    if EVEN_K:
        x = tl.load(x_ptrs).to(tl.float32)
        g = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy=EVICT)
        u = tl.load(w_ptrs + up_off, mask=n_mask[:, None], other=0.0, eviction_policy=EVICT)
    else:
        k_mask = (k0 + offs_k) < KDIM
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        g = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy=EVICT)
        u = tl.load(w_ptrs + up_off, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy=EVICT)
    return x, g, u


@triton.jit
def _gate_up_program(
    x_ptr, w_ptr, ids_ptr, act_ptr, pair, pid_n, N, stride_xt, stride_we, stride_wn, stride_am,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, KDIM: tl.constexpr,
    EVICT: tl.constexpr,
):  # fmt: skip
    """act[pair, BLOCK_N rows from pid_n] (see _gemv_gate_up_kernel); nothing written for an id of -1."""
    expert = tl.load(ids_ptr + pair)
    if expert >= 0:  # else: expert on another rank, the act row stays unset and the down masks it out
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xt + offs_k
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        up_off = N * stride_wn
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        x, g, u = _lanes_load(x_ptrs, w_ptrs, up_off, 0, offs_k, n_mask, KDIM, EVEN_K, EVICT)
        for k0 in tl.static_range(BLOCK_K, KDIM, BLOCK_K):
            x2, g2, u2 = _lanes_load(x_ptrs + k0, w_ptrs + k0, up_off, k0, offs_k, n_mask, KDIM, EVEN_K, EVICT)
            acc_g += g.to(tl.float32) * x[None, :]
            acc_u += u.to(tl.float32) * x[None, :]
            x, g, u = x2, g2, u2
        acc_g += g.to(tl.float32) * x[None, :]
        acc_u += u.to(tl.float32) * x[None, :]
        gate = tl.sum(acc_g, axis=1)
        up = tl.sum(acc_u, axis=1)
        act = gate * tl.sigmoid(gate) * up  # silu(gate) * up in fp32, one rounding (as the grouped path)
        tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_gate_up_kernel(
    # pointers
    x_ptr, w_ptr, ids_ptr, act_ptr,
    # sizes (KDIM = D: unread, the loop takes D as KDIM_UNROLL; kept in the parameter list, whose packing decides the
    # compiled kernel's register allocation and schedule)
    N, KDIM,
    # strides
    stride_xt, stride_we, stride_wn, stride_am,
    # constexpr
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    KDIM_UNROLL: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    # KDIM_UNROLL = D, a compile-time size: the D loop unrolled, each step's loads issued before the previous step's
    # products, so two steps are in flight per program
    _gate_up_program(x_ptr, w_ptr, ids_ptr, act_ptr, tl.program_id(0), tl.program_id(1), N, stride_xt, stride_we,
                     stride_wn, stride_am, TOP_K, BLOCK_N, BLOCK_K, EVEN_K, KDIM_UNROLL, EVICT)  # fmt: skip


@triton.jit
def _down_load(act_ptr, w_ptr, expert, wt, pair, k0, offs_k, w_rows, n_mask, stride_am, stride_we, KDIM,
               EVICT: tl.constexpr):  # fmt: skip
    """One (expert, I step) of the down: act [BK] fp32 times the routed weight, w2 tile [BN, BK]; id -1 masked
    (no traffic, adds zeros)."""
    kk = k0 + offs_k
    k_mask = (kk < KDIM) & ((kk * 0 + expert) >= 0)
    a = tl.load(act_ptr + pair.to(tl.int64) * stride_am + kk, mask=k_mask, other=0.0).to(tl.float32) * wt
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we + w_rows
    w = tl.load(w_base + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy=EVICT)
    return a, w


@triton.jit
def _gemv_down_sum_kernel(
    # pointers
    act_ptr, w_ptr, ids_ptr, wts_ptr, out_ptr,
    # sizes (KDIM = I: unread, as in _gemv_gate_up_kernel)
    N, KDIM,
    # strides
    stride_am, stride_we, stride_wn, stride_ot,
    # constexpr
    TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    KDIM_UNROLL: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    # KDIM_UNROLL = I, a compile-time size: the K experts x I steps unrolled into one chain, the ids of all K experts
    # loaded as one vector first, each step's loads issued before the previous step's products
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    NK: tl.constexpr = (KDIM_UNROLL + BLOCK_K - 1) // BLOCK_K
    offs_e = tl.arange(0, BLOCK_TOPK)  # K padded to a power of 2; the padding is never read back
    experts = tl.load(ids_ptr + t * TOP_K + offs_e, mask=offs_e < TOP_K, other=-1)  # [BLOCK_TOPK]
    wts = tl.load(wts_ptr + t * TOP_K + offs_e, mask=offs_e < TOP_K, other=0.0)
    e0 = tl.sum(tl.where(offs_e == 0, experts, 0))
    w0 = tl.sum(tl.where(offs_e == 0, wts, 0.0))
    a, w = _down_load(act_ptr, w_ptr, e0, w0, t * TOP_K, 0, offs_k, w_rows, n_mask, stride_am, stride_we,
                      KDIM_UNROLL, EVICT)  # fmt: skip
    for step in tl.static_range(1, TOP_K * NK):
        e = tl.sum(tl.where(offs_e == step // NK, experts, 0))
        wt = tl.sum(tl.where(offs_e == step // NK, wts, 0.0))
        a2, w2 = _down_load(act_ptr, w_ptr, e, wt, t * TOP_K + step // NK, (step % NK) * BLOCK_K, offs_k, w_rows,
                            n_mask, stride_am, stride_we, KDIM_UNROLL, EVICT)  # fmt: skip
        acc += w.to(tl.float32) * a[None, :]
        a, w = a2, w2
    acc += w.to(tl.float32) * a[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def _evict(first: bool) -> str:
    """tl.load's eviction_policy: on sm_90 "evict_first" becomes an L2 cache-policy hint on every weight load."""
    return "evict_first" if first else ""


def gemv_gate_up(hidden: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, tile: GemvTile) -> torch.Tensor:
    """hidden [T, D] -> act [T K, I] (rows of pairs with id -1 unset); arguments checked by fused_moe."""
    T, D = hidden.shape
    K = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    act = torch.empty((T * K, inter), dtype=hidden.dtype, device=hidden.device)
    grid = (T * K, triton.cdiv(inter, tile.up_n))
    block_k = min(tile.up_k, triton.next_power_of_2(D))
    _gemv_gate_up_kernel[grid](
        hidden, w13, topk_ids, act, inter, D, hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=K, BLOCK_N=tile.up_n, BLOCK_K=block_k, EVEN_K=D % block_k == 0, KDIM_UNROLL=D,
        EVICT=_evict(tile.up_evict_first), num_warps=tile.up_warps, num_stages=UNROLLED_STAGES,
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
        act, w2, topk_ids, topk_weights, out, D, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=K, BLOCK_TOPK=triton.next_power_of_2(K), BLOCK_N=tile.down_n,
        BLOCK_K=min(tile.down_k, triton.next_power_of_2(inter)), KDIM_UNROLL=inter,
        EVICT=_evict(tile.down_evict_first), num_warps=tile.down_warps, num_stages=UNROLLED_STAGES,
    )  # fmt: skip
    return out


def gemv_moe(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    tile: GemvTile,
) -> torch.Tensor:  # fmt: skip
    """hidden [T, D] -> out [T, D]: the gemv path (gate_up, then down and sum), two launches."""
    return gemv_down_sum(gemv_gate_up(hidden, w13, topk_ids, tile), w2, topk_ids, topk_weights, tile)
