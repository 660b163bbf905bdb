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

from r3trace.kernels.dot import dot_precision, mma
from r3trace.kernels.moe_config import GemvTile


@triton.jit
def _lanes_load(x_ptrs, w_ptrs, up_off, k0, offs_k, n_mask, KDIM, EVEN_K: tl.constexpr):
    """One D step of the gate_up: x [BK] fp32, gate and up weight tiles [BN, BK] (masked past D and N)."""
    if EVEN_K:
        x = tl.load(x_ptrs).to(tl.float32)
        g = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        u = tl.load(w_ptrs + up_off, mask=n_mask[:, None], other=0.0)
    else:
        k_mask = (k0 + offs_k) < KDIM
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        g = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        u = tl.load(w_ptrs + up_off, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    return x, g, u


@triton.jit
def _gate_up_program(
    x_ptr, w_ptr, ids_ptr, act_ptr, pair, pid_n, N, KDIM, stride_xt, stride_we, stride_wn, stride_am,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    KDIM_UNROLL: tl.constexpr,
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
        if KDIM_UNROLL > 0:
            x, g, u = _lanes_load(x_ptrs, w_ptrs, up_off, 0, offs_k, n_mask, KDIM_UNROLL, EVEN_K)
            for k0 in tl.static_range(BLOCK_K, KDIM_UNROLL, BLOCK_K):
                x2, g2, u2 = _lanes_load(x_ptrs + k0, w_ptrs + k0, up_off, k0, offs_k, n_mask, KDIM_UNROLL, EVEN_K)
                acc_g += g.to(tl.float32) * x[None, :]
                acc_u += u.to(tl.float32) * x[None, :]
                x, g, u = x2, g2, u2
            acc_g += g.to(tl.float32) * x[None, :]
            acc_u += u.to(tl.float32) * x[None, :]
        else:
            for k0 in range(0, KDIM, BLOCK_K):
                x, g, u = _lanes_load(x_ptrs, w_ptrs, up_off, k0, offs_k, n_mask, KDIM, EVEN_K)
                acc_g += g.to(tl.float32) * x[None, :]
                acc_u += u.to(tl.float32) * x[None, :]
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
        gate = tl.sum(acc_g, axis=1)
        up = tl.sum(acc_u, axis=1)
        act = gate * tl.sigmoid(gate) * up  # silu(gate) * up in fp32, one rounding (as the grouped path)
        tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, act.to(act_ptr.dtype.element_ty), mask=n_mask)


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
    KDIM_UNROLL: tl.constexpr,
):  # fmt: skip
    # KDIM_UNROLL = D (0: a runtime loop): the D loop unrolled, each step's loads issued before the previous
    # step's products, so two steps are in flight per program (the runtime loop waits one latency per step)
    _gate_up_program(x_ptr, w_ptr, ids_ptr, act_ptr, tl.program_id(0), tl.program_id(1), N, KDIM, stride_xt,
                     stride_we, stride_wn, stride_am, TOP_K, BLOCK_N, BLOCK_K, EVEN_K, KDIM_UNROLL)  # fmt: skip


@triton.jit
def _down_load(act_ptr, w_ptr, expert, wt, pair, k0, offs_k, w_rows, n_mask, stride_am, stride_we, KDIM):
    """One (expert, I step) of the down: act [BK] fp32 times the routed weight, w2 tile [BN, BK]; id -1 masked
    (no traffic, adds zeros)."""
    kk = k0 + offs_k
    k_mask = (kk < KDIM) & ((kk * 0 + expert) >= 0)
    a = tl.load(act_ptr + pair.to(tl.int64) * stride_am + kk, mask=k_mask, other=0.0).to(tl.float32) * wt
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we + w_rows
    w = tl.load(w_base + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    return a, w


@triton.jit
def _gemv_down_sum_kernel(
    # pointers
    act_ptr, w_ptr, ids_ptr, wts_ptr, out_ptr,
    # sizes
    N, KDIM,
    # strides
    stride_am, stride_we, stride_wn, stride_ot,
    # constexpr
    TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    KDIM_UNROLL: tl.constexpr,
):  # fmt: skip
    # KDIM_UNROLL = I (0: a runtime loop per expert): the K experts x I steps unrolled into one chain, the
    # ids of all K experts loaded as one vector first, each step's loads issued before the previous step's
    # products (with a runtime loop per expert, a program waits K latencies one after another)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    if KDIM_UNROLL > 0:
        NK: tl.constexpr = (KDIM_UNROLL + BLOCK_K - 1) // BLOCK_K
        offs_e = tl.arange(0, BLOCK_TOPK)  # K padded to a power of 2; the padding is never read back
        experts = tl.load(ids_ptr + t * TOP_K + offs_e, mask=offs_e < TOP_K, other=-1)  # [BLOCK_TOPK]
        wts = tl.load(wts_ptr + t * TOP_K + offs_e, mask=offs_e < TOP_K, other=0.0)
        e0 = tl.sum(tl.where(offs_e == 0, experts, 0))
        w0 = tl.sum(tl.where(offs_e == 0, wts, 0.0))
        a, w = _down_load(act_ptr, w_ptr, e0, w0, t * TOP_K, 0, offs_k, w_rows, n_mask, stride_am, stride_we,
                          KDIM_UNROLL)  # fmt: skip
        for step in tl.static_range(1, TOP_K * NK):
            e = tl.sum(tl.where(offs_e == step // NK, experts, 0))
            wt = tl.sum(tl.where(offs_e == step // NK, wts, 0.0))
            a2, w2 = _down_load(act_ptr, w_ptr, e, wt, t * TOP_K + step // NK, (step % NK) * BLOCK_K, offs_k, w_rows,
                                n_mask, stride_am, stride_we, KDIM_UNROLL)  # fmt: skip
            acc += w.to(tl.float32) * a[None, :]
            a, w = a2, w2
        acc += w.to(tl.float32) * a[None, :]
    else:
        for k in tl.static_range(TOP_K):
            pair = t * TOP_K + k
            expert = tl.load(ids_ptr + pair)
            wt = tl.load(wts_ptr + pair)
            for k0 in range(0, KDIM, BLOCK_K):
                a, w = _down_load(act_ptr, w_ptr, expert, wt, pair, k0, offs_k, w_rows, n_mask, stride_am, stride_we,
                                  KDIM)  # fmt: skip
                acc += w.to(tl.float32) * a[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _down_rows_program(
    act_ptr, w_ptr, ids_ptr, wts_ptr, out_ptr, t, pid_n, N, KDIM, stride_am, stride_we, stride_wn, stride_ot,
    sync_ptr, num_up, TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WAIT: tl.constexpr, SPIN_MAX: tl.constexpr,
):  # fmt: skip
    """out[t, BLOCK_N rows from pid_n] with the K experts' rows stacked into one [BLOCK_TOPK BLOCK_N, BLOCK_K]
    tile per step: every expert's weights in flight together. WAIT (the fused kernel): spin until num_up
    gate_up programs have counted themselves done in sync_ptr[0], between the weight and the act loads."""
    r = tl.arange(0, BLOCK_TOPK * BLOCK_N)  # row r: expert slot r // BLOCK_N, output row r % BLOCK_N
    slot = r // BLOCK_N
    offs_n = pid_n * BLOCK_N + r % BLOCK_N
    pair = t * TOP_K + slot
    expert = tl.load(ids_ptr + pair, mask=slot < TOP_K, other=-1)  # [R]: K distinct addresses, cached
    wt = tl.load(wts_ptr + pair, mask=expert >= 0, other=0.0)
    on = (expert >= 0) & (offs_n < N)  # id -1 (another rank), K padded to a power of 2, rows past D: masked
    w_rows = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wn
    a_rows = act_ptr + pair.to(tl.int64) * stride_am
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_TOPK * BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        kk = k0 + offs_k
        mask = on[:, None] & (kk < KDIM)[None, :]
        w = tl.load(w_rows[:, None] + kk[None, :], mask=mask, other=0.0)
        if WAIT:  # after the first step the count is final: one load and out
            seen = tl.load(sync_ptr, volatile=True)
            spins = 0
            while (seen < num_up) & (spins < SPIN_MAX):  # SPIN_MAX: a bound, so a broken count cannot hang
                seen = tl.load(sync_ptr, volatile=True)
                spins += 1
            a = tl.load(a_rows[:, None] + kk[None, :], mask=mask, other=0.0, cache_modifier=".cg")  # L2: fresh
        else:
            a = tl.load(a_rows[:, None] + kk[None, :], mask=mask, other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)
    y = tl.sum(acc, axis=1) * wt  # [R]
    out = tl.sum(tl.reshape(y, (BLOCK_TOPK, BLOCK_N)), axis=0)  # [BN]: the K experts summed in fp32
    offs_o = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_o, out.to(out_ptr.dtype.element_ty), mask=offs_o < N)


@triton.jit
def _gemv_down_rows_kernel(
    # pointers
    act_ptr, w_ptr, ids_ptr, wts_ptr, out_ptr,
    # sizes
    N, KDIM,
    # strides
    stride_am, stride_we, stride_wn, stride_ot,
    # constexpr
    TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    _down_rows_program(act_ptr, w_ptr, ids_ptr, wts_ptr, out_ptr, tl.program_id(0), tl.program_id(1), N, KDIM,
                       stride_am, stride_we, stride_wn, stride_ot, ids_ptr, 0, TOP_K, BLOCK_TOPK, BLOCK_N, BLOCK_K,
                       False, 0)  # fmt: skip


@triton.jit
def _gemv_fused_kernel(
    # pointers
    x_ptr, w13_ptr, w2_ptr, ids_ptr, wts_ptr, act_ptr, out_ptr, sync_ptr,
    # sizes
    I, D, up_tiles, down_tiles, num_up, num_down,
    # strides
    stride_xt, stride_w13e, stride_w13n, stride_am, stride_w2e, stride_w2n, stride_ot,
    # constexpr
    TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr, UP_N: tl.constexpr, UP_K: tl.constexpr, EVEN_K: tl.constexpr,
    KDIM_UNROLL: tl.constexpr, DOWN_N: tl.constexpr, DOWN_K: tl.constexpr, SPIN_MAX: tl.constexpr,
):  # fmt: skip
    # both kernels in one launch: programs [0, num_up) run the gate_up and count themselves done in sync[0];
    # the rest run the down, their weight loads issued while the gate_up still runs, their act loads after
    # the count reaches num_up. Programs start in id order, so every gate_up program has started before any
    # down program waits: no deadlock. The last down program to finish (sync[1]) zeroes both counts for the
    # next launch, so no memset node is needed in a graph.
    pid = tl.program_id(0)
    if pid < num_up:
        _gate_up_program(x_ptr, w13_ptr, ids_ptr, act_ptr, pid // up_tiles, pid % up_tiles, I, D, stride_xt,
                         stride_w13e, stride_w13n, stride_am, TOP_K, UP_N, UP_K, EVEN_K, KDIM_UNROLL)  # fmt: skip
        tl.debug_barrier()  # every thread's act stores before the release below
        tl.atomic_add(sync_ptr, 1, sem="release")
    else:
        q = pid - num_up
        _down_rows_program(act_ptr, w2_ptr, ids_ptr, wts_ptr, out_ptr, q // down_tiles, q % down_tiles, D, I,
                           stride_am, stride_w2e, stride_w2n, stride_ot, sync_ptr, num_up, TOP_K, BLOCK_TOPK, DOWN_N,
                           DOWN_K, True, SPIN_MAX)  # fmt: skip
        if tl.atomic_add(sync_ptr + 1, 1) == num_down - 1:  # the last down program: every program is past its wait
            tl.store(sync_ptr, 0)
            tl.store(sync_ptr + 1, 0)


@triton.jit
def _gemv_gate_up_dot_kernel(
    # pointers
    x_ptr, w_ptr, ids_ptr, act_ptr,
    # sizes
    N, KDIM,
    # strides
    stride_xt, stride_we, stride_wn, stride_am,
    # constexpr
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # the same product as _gemv_gate_up_kernel as a tensor-core product with M padded to 16 (row 0 the pair's
    # token, rows 1-15 masked: no traffic): loads that feed a dot are what Triton's pipeliner keeps
    # num_stages deep in flight (cp.async into shared memory), where plain loads wait one at a time
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair)
    if expert < 0:
        return
    offs_m = tl.arange(0, 16)
    row0 = offs_m[:, None] == 0  # [16, 1]
    offs_k = tl.arange(0, BLOCK_K)
    j = tl.arange(0, 2 * BLOCK_N)  # weight columns: gate n, up n, gate n + 1, ... (split in the epilogue)
    n_of_j = pid_n * BLOCK_N + j // 2
    w_mask = n_of_j < N
    a_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xt + offs_m[:, None] * 0 + offs_k[None, :]  # [16, BK]
    w_rows = (n_of_j + (j % 2) * N).to(tl.int64)
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + w_rows[None, :] * stride_wn + offs_k[:, None]  # [BK, 2 BN]
    acc = tl.zeros((16, 2 * BLOCK_N), tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row0, other=0.0)
            w = tl.load(w_ptrs, mask=w_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + offs_k) < KDIM
            a = tl.load(a_ptrs, mask=row0 & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & w_mask[None, :], other=0.0)
        acc += mma(a, w, UPCAST, INPUT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    gate, up = tl.split(tl.reshape(acc, (16, BLOCK_N, 2)))
    act = gate * tl.sigmoid(gate) * up  # [16, BN], row 0 real
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_ptrs = act_ptr + pair.to(tl.int64) * stride_am + offs_m[:, None] * 0 + offs_n[None, :]
    tl.store(o_ptrs, act.to(act_ptr.dtype.element_ty), mask=row0 & (offs_n < N)[None, :])


def gemv_gate_up(hidden: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, tile: GemvTile) -> torch.Tensor:
    """hidden [T, D] -> act [T K, I] (rows of pairs with id -1 unset); arguments checked by fused_moe."""
    T, D = hidden.shape
    K = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    act = torch.empty((T * K, inter), dtype=hidden.dtype, device=hidden.device)
    grid = (T * K, triton.cdiv(inter, tile.up_n))
    args = (hidden, w13, topk_ids, act, inter, D, hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0))
    if tile.up_dot:
        block_k = max(16, min(tile.up_k, triton.next_power_of_2(D)))  # tl.dot's minimum
        _gemv_gate_up_dot_kernel[grid](
            *args, TOP_K=K, BLOCK_N=tile.up_n, BLOCK_K=block_k, EVEN_K=D % block_k == 0,
            UPCAST=not hidden.is_cuda, INPUT_PRECISION=dot_precision(hidden.dtype == torch.float32),
            num_warps=tile.up_warps, num_stages=tile.up_stages,
        )  # fmt: skip
    else:
        block_k = min(tile.up_k, triton.next_power_of_2(D))
        _gemv_gate_up_kernel[grid](
            *args, TOP_K=K, BLOCK_N=tile.up_n, BLOCK_K=block_k, EVEN_K=D % block_k == 0,
            KDIM_UNROLL=D if tile.unroll else 0, num_warps=tile.up_warps, num_stages=tile.up_stages,
        )  # fmt: skip
    return act


def gemv_down_sum(
    act: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, tile: GemvTile
) -> torch.Tensor:
    """act [T K, I] -> out [T, D] = sum over k of topk_weight * act W2^T, ids of -1 contributing nothing."""
    T, K = topk_ids.shape
    D, inter = w2.shape[1], w2.shape[2]
    out = torch.empty((T, D), dtype=act.dtype, device=act.device)
    args = (act, w2, topk_ids, topk_weights, out, D, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0))
    block_k = min(tile.down_k, triton.next_power_of_2(inter))
    grid = (T, triton.cdiv(D, tile.down_n))
    if tile.down_rows:
        _gemv_down_rows_kernel[grid](
            *args, TOP_K=K, BLOCK_TOPK=triton.next_power_of_2(K), BLOCK_N=tile.down_n, BLOCK_K=block_k,
            num_warps=tile.down_warps, num_stages=tile.down_stages,
        )  # fmt: skip
    else:
        _gemv_down_sum_kernel[grid](
            *args, TOP_K=K, BLOCK_TOPK=triton.next_power_of_2(K), BLOCK_N=tile.down_n, BLOCK_K=block_k,
            KDIM_UNROLL=inter if tile.unroll else 0, num_warps=tile.down_warps, num_stages=tile.down_stages,
        )  # fmt: skip
    return out


# Per-device [2] int32 counts of the fused kernel, zero between launches (the kernel re-zeroes them). A cache,
# not state: made once outside any graph capture (a capture would own its memory), then only its address is
# used. Two fused launches may not run at once on one device (streams run the MoE one after another here).
_SYNC_COUNTS: dict[torch.device, torch.Tensor] = {}
SPIN_MAX = 1 << 16  # ~50 ms of polling at most: a broken count gives wrong numbers (tests fail), never a hang


def _sync_counts(device: torch.device) -> torch.Tensor | None:
    if device not in _SYNC_COUNTS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _SYNC_COUNTS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return _SYNC_COUNTS[device]


def gemv_moe(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    tile: GemvTile,
) -> torch.Tensor:  # fmt: skip
    """hidden [T, D] -> out [T, D]: the gemv path, one launch if tile.fused (and a count buffer exists outside
    a capture: else two), else gate_up then down."""
    sync = _sync_counts(hidden.device) if tile.fused else None
    if sync is None:
        act = gemv_gate_up(hidden, w13, topk_ids, tile)
        return gemv_down_sum(act, w2, topk_ids, topk_weights, tile)
    T, D = hidden.shape
    K = topk_ids.shape[1]
    inter = w13.shape[1] // 2
    act = torch.empty((T * K, inter), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((T, D), dtype=hidden.dtype, device=hidden.device)
    up_tiles, down_tiles = triton.cdiv(inter, tile.up_n), triton.cdiv(D, tile.down_n)
    num_up, num_down = T * K * up_tiles, T * down_tiles
    up_k = min(tile.up_k, triton.next_power_of_2(D))
    _gemv_fused_kernel[(num_up + num_down,)](
        hidden, w13, w2, topk_ids, topk_weights, act, out, sync, inter, D, up_tiles, down_tiles, num_up, num_down,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=K, BLOCK_TOPK=triton.next_power_of_2(K), UP_N=tile.up_n, UP_K=up_k, EVEN_K=D % up_k == 0,
        KDIM_UNROLL=D if tile.unroll else 0, DOWN_N=tile.down_n,
        DOWN_K=min(tile.down_k, triton.next_power_of_2(inter)), SPIN_MAX=SPIN_MAX, num_warps=tile.up_warps,
    )  # fmt: skip
    return out
