"""A batch-invariant matmul: row m of the product has the same bits whatever M is and whatever the other rows hold
(EngineConfig.batch_invariant's linears and per-head products).

Shape legend: G batched products (1 for a linear, H heads for MLA's absorbed w_kc / w_vc), M rows, K the reduced
dim, N output columns.

    a   [G, M, K] (any strides)   b [G, K, N] (any strides)   c [G, M, N] = a @ b, fp32 accumulation

Why not cuBLAS: it picks its kernel, tile and split-K by M (and N, K), so a row's reduction order, hence its
bits, moves with the batch it lands in (BENCHMARKS.md#speculative-decoding: 79 route mismatches between two plain
runs that batch the same requests differently). Here element (m, n) is one fp32 accumulator that takes the tensor
cores' 16-wide K steps in order from 0, whatever the tile: BLOCK_K only groups those steps and BLOCK_M / BLOCK_N only
say which outputs a program owns, so the tile may follow M and N (matmul_tile) and no K is ever split. On the H200, 9
products of the 2.5B shape (K 512-5632, N 576-32000) gave each row's bits at M = 1 .. 700 with BLOCK_K 64 / 128 / 256
equal to the 128 x 256 x 64 tile's at M = 8192, and 9 tiles at M = 128 .. 4096 (BLOCK_M 64 / 128 / 256, BLOCK_N 32 ..
256, BLOCK_K 64 / 128) equal to it again (tests/kernels/test_batch_invariance.py crosses the tiles there).
SGLang's --enable-deterministic-inference keeps one persistent-kernel config per dtype for every M and no split-K
(sgl-project/sglang python/sglang/srt/batch_invariant_ops/batch_invariant_ops.py at d40bdca0, `matmul_persistent`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from r3trace.kernels.contract import FLOAT_DTYPES, require
from r3trace.kernels.dot import dot_precision, row_mma_acc


class MatmulTile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Triton's CPU interpreter and fp32, at every M: the interpreter's row_mma sums a BLOCK_K block before adding it (its
# bits follow BLOCK_K), and fp32's 'ieee' products are not the tensor cores' (not measured across tiles). fp32 halves
# each side so an fp32 stage of A and B fits the shared memory of 3 stages.
TILES: dict[torch.dtype, MatmulTile] = {
    torch.bfloat16: MatmulTile(64, 64, 64, 4, 3),
    torch.float16: MatmulTile(64, 64, 64, 4, 3),
    torch.float32: MatmulTile(32, 32, 32, 4, 2),
}
# From WIDE_M rows (16-bit, prompt chunks): 128 x 128 x 64 tiles over 8 warps, 3 stages, the fastest of 9 tiles over
# the 2.5B shape's 9 products at M = 1024 and 4096 on the H200 (graph-timed sums: 537 and 2,019 us against 665 and
# 2,172 for 128 x 256 x 64; cuBLAS 334 and 1,301). At M = 4096: K 2048 x N 2048 58 us (cuBLAS 46), K 5632 x N 2048
# 153 (118), the lm_head's N 32000 1,242 (765). Re-measure: python -m bench.invariant_gemm.
WIDE_M = 512
WIDE_TILES: dict[torch.dtype, MatmulTile] = {
    torch.bfloat16: MatmulTile(128, 128, 64, 8, 3),
    torch.float16: MatmulTile(128, 128, 64, 8, 3),
}
# Below WIDE_M rows (16-bit, decode and verify sizes): BLOCK_M the MMA's 16 / 32 / 64 rows by M, BLOCK_K 128, and the
# widest BLOCK_N of 128 / 64 / 32 / 16 that still gives MIN_PROGRAMS programs (132 SMs): the weights stream from many
# SMs at once. At M = 64 (us, cuBLAS beside): K 2048 x N 2048 5.3 (5.4), K 768 x N 3072 4.2 (3.7), K 5632 x N 2048
# 10.6 (9.3), K 512 x N 2048 2.7 (3.2); fixed 512-wide K chunks with split-K took 6.6, 6.0, 10.8 and 3.7. The split
# only won at M = 1 on K 5632 (9.1 against 12.1). Re-measure: python -m bench.invariant_gemm.
NARROW_BLOCK_K = 128
MIN_PROGRAMS = 128
SMEM_BYTES = 200_000  # the most shared memory a tile's stages may take (the H200 has 227 KB a block)


def matmul_tile(dtype: torch.dtype, m: int, n: int = 0, g: int = 1, compiled: bool = True) -> MatmulTile:
    """The tile of g [M, K] x [K, N] products: WIDE_TILES[dtype] from WIDE_M rows, below it the narrow rule above;
    TILES[dtype] for fp32 and compiled=False (Triton's CPU interpreter, which also caps a tensor at 2^20 elements)."""
    wide = WIDE_TILES.get(dtype)
    if wide is None or not compiled:
        return TILES[dtype]
    if m >= WIDE_M:
        return wide
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = next((bn for bn in (128, 64, 32) if g * triton.cdiv(n, bn) * triton.cdiv(m, block_m) >= MIN_PROGRAMS),
                   16)  # fmt: skip
    stages = 4
    while stages > 2 and (block_m + block_n) * NARROW_BLOCK_K * dtype.itemsize * stages > SMEM_BYTES:
        stages -= 1
    return MatmulTile(block_m, block_n, NARROW_BLOCK_K, 4, stages)


@triton.jit
def _invariant_matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    # sizes
    M, N, K,
    # strides
    stride_ag, stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_cg, stride_cm, stride_cn,
    # constexpr
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # c[g, m, n] = one fp32 accumulator over K's BLOCK_K steps in order from 0 (the MMA's acc operand), then rounded
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + g * stride_ag + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + g * stride_bg + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_rows + (k0 + offs_k)[None, :] * stride_ak, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + (k0 + offs_k)[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = row_mma_acc(a, b, acc, UPCAST, INPUT_PRECISION)  # the MMA accumulates into acc
    dst = c_ptr + g * stride_cg + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def invariant_bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [G, M, K] @ b [G, K, N] -> [G, M, N] in a's dtype (out: a [G, M, N] tensor or view to store into; any
    strides). The tile is matmul_tile(a.dtype, M, N, G); K is one accumulator's steps in order at every tile."""
    require(a.dim() == 3 and b.dim() == 3, f"a {tuple(a.shape)} and b {tuple(b.shape)} must be [G, M, K], [G, K, N]")
    require(a.dtype in FLOAT_DTYPES and b.dtype == a.dtype, f"a dtype {a.dtype}, b dtype {b.dtype}: one float dtype")
    require(a.device == b.device, f"a is on {a.device}, b on {b.device}")
    g, m, k = a.shape
    require(b.shape[0] == g and b.shape[1] == k, f"b shape {tuple(b.shape)} is not [G={g}, K={k}, N]")
    n = b.shape[2]
    if out is None:
        out = torch.empty((g, m, n), dtype=a.dtype, device=a.device)
    require(tuple(out.shape) == (g, m, n) and out.dtype == a.dtype,
            f"out {tuple(out.shape)} {out.dtype} is not [{g}, {m}, {n}] {a.dtype}")  # fmt: skip
    if g * m * n == 0:
        return out
    tile = matmul_tile(a.dtype, m, n, g, a.is_cuda)
    _invariant_matmul_kernel[(triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m), g)](
        a, b, out, m, n, k,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, UPCAST=not a.is_cuda,
        INPUT_PRECISION=dot_precision(a.dtype == torch.float32), num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out


def invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, In] @ w [Out, In]^T -> [T, Out] in x's dtype: a linear's product, batch-invariant (F.linear's contract)."""
    require(x.dim() == 2 and w.dim() == 2 and w.shape[1] == x.shape[1],
            f"x {tuple(x.shape)} and w {tuple(w.shape)} are not [T, In], [Out, In]")  # fmt: skip
    return invariant_bmm(x.unsqueeze(0), w.t().unsqueeze(0))[0]


def invariant_bmm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The twin: fp32 torch.bmm rounded to a's dtype ([G, M, K] @ [G, K, N] -> [G, M, N]); equal up to fp32 order."""
    return torch.bmm(a.float(), b.float()).to(a.dtype)
