"""The grouped GEMM of the fused MoE (fused_moe.py's steps 2 and 3): one Triton kernel for gate_up
(+SiLU-and-mul) and down over the expert-sorted, BLOCK_M-padded pairs of moe_align, its launcher, and the
two entry points moe_gate_up / moe_down.

Shape legend as in fused_moe.py: T tokens, D hidden, E local experts, I moe_intermediate_size, K top-k,
M = T*K pairs, P = the padded pair count (moe_align's cap). Tiles come from config.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from r3trace.kernels.dot import dot_precision, mma, row_mma
from r3trace.kernels.moe.align import MoeAlignment, has_pdl
from r3trace.kernels.moe.config import GemmTile

__all__ = ["moe_down", "moe_gate_up"]


@triton.jit
def _product(a, w, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, ROW_DOT: tl.constexpr):
    """a @ w in fp32: row_mma for the batch-invariant plan (GemmTile.row_dot), mma otherwise."""
    if ROW_DOT:
        return row_mma(a, w, UPCAST, INPUT_PRECISION)
    else:
        return mma(a, w, UPCAST, INPUT_PRECISION)


@triton.jit
def _fused_moe_kernel(
    # pointers (w_desc: the TMA descriptor of w when W_TMA, else unused)
    a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_weights_ptr, w_desc,
    # sizes
    N, KDIM, num_pairs, cap, a_row_div,
    # strides
    stride_am, stride_we, stride_wn, stride_om,
    # constexpr
    GATE_UP: tl.constexpr, EVEN_K: tl.constexpr, INTERLEAVE: tl.constexpr, W_COLS: tl.constexpr,
    N_SPLIT: tl.constexpr, W_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, ROW_DOT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # GATE_UP: out[pair, n] = silu(a W[n]) * (a W[N + n]), a = hidden[pair // K]   (N = I, KDIM = D)
    # DOWN:    out[pair, n] = topk_weight[pair] * (a W[n]), a = act[pair]         (N = D, KDIM = I)
    # INTERLEAVE (gate_up only): one [K, 2 BLOCK_N] weight tile, columns gate n, up n alternating, so one
    # N = 2 BLOCK_N product replaces two; the pairs sit side by side in the accumulator, split at the end
    # N_SPLIT > 0 (down, BLOCK_K >= KDIM): the A tile is loaded once and the program walks every N_SPLIT-th
    # N tile, so the weight loads of one tile pipeline under the product and store of the previous: with
    # K = I = 256 a one-tile program is mostly prologue and epilogue (1.72 ms at E = 256, T = 16k: 314 TF/s)
    # W_TMA: weight tiles through a TMA descriptor (no per-thread address math, out-of-range rows and K read as
    # zeros); w_desc is [E, I, 2, D] interleaved (box [1, BN, 2, BK]) or [E 2I, D] for gate_up, [E D, I] for down.
    # A tiles stay pointer loads: the gate_up's A is a row gather (hidden[pair // K]) and Hopper's TMA has no gather
    if PDL:  # a programmatic dependent: nothing global is touched before the kernel ahead is complete
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(cap, BLOCK_M)
    if N_SPLIT > 0:  # noqa: SIM108 (a constexpr branch, resolved when the kernel compiles)
        num_pid_n = N_SPLIT
    else:
        num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    # three independent loads issued together (in bounds for every pid_m < P / BLOCK_M), then the exit:
    # at T = 1 each dependent load would add ~1 us of latency before the weight stream starts
    num_padded = tl.load(num_padded_ptr)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    if pid_m * BLOCK_M >= num_padded:  # past the device-side row count: unused block, garbage ids
        return
    pair_mask = pairs < num_pairs
    a_rows = (pairs // a_row_div).to(tl.int64)
    w_row0 = expert.to(tl.int32) * N  # first row of this expert in the [E N, KDIM] weight descriptor
    offs_k = tl.arange(0, BLOCK_K)
    if N_SPLIT > 0:
        k_mask = offs_k < KDIM
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=pair_mask[:, None] & k_mask[None, :],
                    other=0.0)  # fmt: skip
        wt = tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)
        w_base = w_ptr + expert * stride_we + offs_k[:, None]
        for n0 in range(pid_n * BLOCK_N, N, N_SPLIT * BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            if W_TMA:  # rows past N belong to the next expert (or read as zeros): their columns are not stored
                w = w_desc.load([w_row0 + n0, 0]).T
            else:
                w = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn, mask=k_mask[:, None] & n_mask[None, :],
                            other=0.0)  # fmt: skip
            acc = _product(a, w, UPCAST, INPUT_PRECISION, ROW_DOT) * wt[:, None]
            tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])  # fmt: skip
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        if INTERLEAVE:
            j = tl.arange(0, W_COLS)
            w_rows = pid_n * BLOCK_N + j // 2 + (j % 2) * N  # [2 BLOCK_N]: gate n, up n, gate n+1, ...
            w_mask = (pid_n * BLOCK_N + j // 2) < N
        else:
            w_rows = offs_n
            w_mask = n_mask
        w_ptrs = w_ptr + expert * stride_we + w_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K, W]
        acc = tl.zeros((BLOCK_M, W_COLS), tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        n0 = pid_n * BLOCK_N
        up_row0 = w_row0 + expert.to(tl.int32) * N + n0  # gate_up's [E 2I, D] descriptor: expert e starts at 2 e I
        for k0 in range(0, KDIM, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=pair_mask[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=pair_mask[:, None] & ((k0 + offs_k) < KDIM)[None, :], other=0.0)
            if W_TMA and INTERLEAVE:  # [1, BN, 2, BK] -> rows gate n, up n, gate n+1, ... -> [BK, 2 BN]
                w = tl.reshape(w_desc.load([expert.to(tl.int32), n0, 0, k0]), (W_COLS, BLOCK_K)).T
            elif W_TMA and GATE_UP:
                w = w_desc.load([up_row0, k0]).T
            elif W_TMA:
                w = w_desc.load([w_row0 + n0, k0]).T
            elif EVEN_K:
                w = tl.load(w_ptrs, mask=w_mask[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=((k0 + offs_k) < KDIM)[:, None] & w_mask[None, :], other=0.0)
            acc += _product(a, w, UPCAST, INPUT_PRECISION, ROW_DOT)
            if GATE_UP and not INTERLEAVE:
                if W_TMA:
                    w_up = w_desc.load([up_row0 + N, k0]).T
                elif EVEN_K:
                    w_up = tl.load(w_ptrs + N * stride_wn, mask=n_mask[None, :], other=0.0)
                else:
                    w_up = tl.load(w_ptrs + N * stride_wn, mask=((k0 + offs_k) < KDIM)[:, None] & n_mask[None, :],
                                   other=0.0)  # fmt: skip
                acc_up += _product(a, w_up, UPCAST, INPUT_PRECISION, ROW_DOT)
            a_ptrs += BLOCK_K
            if not W_TMA:
                w_ptrs += BLOCK_K

        if INTERLEAVE:
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
            acc = gate * tl.sigmoid(gate) * up
        elif GATE_UP:
            acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up, in fp32 before the one rounding
        else:
            acc = acc * tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)[:, None]
        o_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


def _tma_ok(t: torch.Tensor, rows_stride: int) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and 16-byte multiples for every stride but the last."""
    return t.data_ptr() % 16 == 0 and rows_stride * t.element_size() % 16 == 0


def _weight_desc(w: torch.Tensor, tile: GemmTile, gate_up: bool, interleave: bool) -> TensorDescriptor:
    """w13 [E, 2I, D] as [E, I, 2, D] (rows gate i, up i adjacent: the interleaved tile in one box) or [E 2I, D];
    w2 [E, D, I] as [E D, I]. Boxes past a dimension's end read zeros."""
    E, rows, kdim = w.shape
    if gate_up and interleave:
        view = w.view(E, 2, rows // 2, kdim).permute(0, 2, 1, 3)  # [E, I, 2, D], strides (2ID, D, ID, 1)
        return TensorDescriptor(w, list(view.shape), list(view.stride()), [1, tile.block_n, 2, tile.block_k])
    return TensorDescriptor(w, [E * rows, kdim], [kdim, 1], [tile.block_n, tile.block_k])


def _launch_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: MoeAlignment, topk_weights: torch.Tensor,
    block_m: int, tile: GemmTile, gate_up: bool, a_row_div: int, pdl: bool,
) -> None:  # fmt: skip
    N = out.shape[1]
    kdim = a.shape[1]
    cap = align.sorted_ids.shape[0]
    # grid from the host-side bound P; programs past the device-side num_padded return after one load
    n_split = tile.n_split if not gate_up and 0 < kdim <= tile.block_k else 0
    grid = ((cap // block_m) * (n_split or triton.cdiv(N, tile.block_n)),)
    interleave = gate_up and tile.interleave
    # tile.tma is a request: strides that are not 16-byte multiples (odd tiny models) keep the pointer loads
    pdl = pdl and has_pdl(a)
    w_tma = tile.tma and _tma_ok(w, kdim)
    w_desc = _weight_desc(w, tile, gate_up, interleave) if w_tma else w
    _fused_moe_kernel[grid](
        a, w, out, align.sorted_ids, align.block_expert, align.num_padded, topk_weights, w_desc,
        N, kdim, a.shape[0] * a_row_div if gate_up else out.shape[0], cap, a_row_div,  # M pairs: T K or y's rows
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATE_UP=gate_up, EVEN_K=kdim % tile.block_k == 0, INTERLEAVE=interleave,
        W_COLS=tile.block_n * (2 if interleave else 1), N_SPLIT=n_split, W_TMA=w_tma,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        UPCAST=not a.is_cuda, INPUT_PRECISION=dot_precision(a.dtype == torch.float32), ROW_DOT=tile.row_dot,
        PDL=pdl, num_warps=tile.num_warps, num_stages=tile.num_stages, launch_pdl=pdl,
    )  # fmt: skip


def moe_gate_up(
    hidden: torch.Tensor, w13: torch.Tensor, align: MoeAlignment, top_k: int, block_m: int, tile: GemmTile,
    pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """hidden [T, D] -> act [M, I] = silu(x W_gate^T) * (x W_up^T) at each pair's index (rows of skipped pairs
    unset)."""
    act = torch.empty((hidden.shape[0] * top_k, w13.shape[1] // 2), dtype=hidden.dtype, device=hidden.device)
    _launch_gemm(hidden, w13, act, align, act, block_m, tile, True, top_k, pdl)  # topk_weights unused: act
    return act


def moe_down(
    act: torch.Tensor, w2: torch.Tensor, align: MoeAlignment, topk_weights: torch.Tensor, block_m: int,
    tile: GemmTile, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """act [M, I] -> y [M, D] = topk_weight * (act W2^T) per pair (rows of skipped pairs unset)."""
    y = torch.empty((act.shape[0], w2.shape[1]), dtype=act.dtype, device=act.device)
    _launch_gemm(act, w2, y, align, topk_weights, block_m, tile, False, 1, pdl)
    return y
