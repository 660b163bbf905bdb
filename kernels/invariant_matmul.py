"""A batch-invariant matmul: row m of the product has the same bits whatever M is and whatever the other rows hold
(EngineConfig.batch_invariant's linears and per-head products).

Shape legend: G batched products (1 for a linear, H heads for MLA's absorbed w_kc / w_vc), M rows, K the reduced
dim, N output columns, C = cdiv(K, K_CHUNK) chunks of K.

    a   [G, M, K] (any strides)   b [G, K, N] (any strides)   c [G, M, N] = a @ b, fp32 accumulation

Why not cuBLAS: it picks its kernel, tile and split-K by M (and N, K), so a row's reduction order, hence its
bits, moves with the batch it lands in (BENCHMARKS.md#speculative-decoding: 79 route mismatches between two plain
runs that batch the same requests differently). Here element (m, n) is one sum for any M: each K chunk of K_CHUNK is
its tensor-core products in BLOCK_K steps accumulated from 0, and the chunks are added in order from 0.0. One program
walks every chunk of its output tile, or, where the output has few tiles (decode), each chunk gets its own program
and a second kernel adds them in the same order (a fixed split-K: the same bits). BLOCK_K is fixed per dtype (TILES);
BLOCK_M and BLOCK_N only say which outputs a program owns, so from WIDE_M rows a 16-bit product takes a wider tile of
the same BLOCK_K (WIDE_TILES): the tensor cores sum each output's K steps in the same order whatever the tile (checked
bitwise on the H200 across the thresholds: tests/kernels/test_batch_invariance.py). SGLang's
--enable-deterministic-inference keeps one persistent-kernel config per dtype for every M and no split-K
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


# The tile below WIDE_M rows, per dtype. 16-bit: 64 x 64 x 64 over 4 warps (a wgmma-sized tile; 64 columns a program
# keep skinny decode GEMMs at N / 64 programs, e.g. 9 for the 576-wide kv_a projection). fp32 halves each side so an
# fp32 stage of A and B fits the shared memory of 3 stages.
TILES: dict[torch.dtype, MatmulTile] = {
    torch.bfloat16: MatmulTile(64, 64, 64, 4, 3),
    torch.float16: MatmulTile(64, 64, 64, 4, 3),
    torch.float32: MatmulTile(32, 32, 32, 4, 2),
}
# From WIDE_M rows (16-bit): 128 x 256 tiles over 8 warps, BLOCK_K as TILES'. At M = 16k, K = 5632, N = 2048 on the
# H200 with the chunked K sum: 0.767 ms, 128 x 128 over 8 warps 0.921, over 4 0.877 (cuBLAS 0.519 in the tile sweep
# before the chunks; bench/results/invariant_gemm_tiles-h200.json has the five shapes).
WIDE_M = 512
WIDE_TILES: dict[torch.dtype, MatmulTile] = {
    torch.bfloat16: MatmulTile(128, 256, 64, 8, 3),
    torch.float16: MatmulTile(128, 256, 64, 8, 3),
}


# K is summed in chunks of K_CHUNK (a multiple of every BLOCK_K), the chunks added in order from 0.0, at every M: so a
# product with few output tiles (decode: M <= 64) can give each chunk its own program and add them after (split-K)
# with the bits of one program walking all chunks. Below SPLIT_BELOW output tiles a product splits (132 SMs).
K_CHUNK = 512
SPLIT_BELOW = 128


def matmul_tile(dtype: torch.dtype, m: int, compiled: bool = True) -> MatmulTile:
    """The tile of an [M, K] x [K, N] product: TILES[dtype], or WIDE_TILES[dtype] from WIDE_M rows; one BLOCK_K.
    compiled=False (Triton's CPU interpreter): TILES' only, as the interpreter caps a tensor at 2^20 elements and
    row_mma's product there is [BLOCK_M, BLOCK_K, BLOCK_N] (2^21 for the wide tile)."""
    wide = WIDE_TILES.get(dtype) if compiled else None
    return wide if wide is not None and m >= WIDE_M else TILES[dtype]


@triton.jit
def _invariant_matmul_kernel(
    # pointers (part_ptr: SPLIT's fp32 chunk sums [C, G, M, N], contiguous)
    a_ptr, b_ptr, c_ptr, part_ptr,
    # sizes
    M, N, K, n_chunks, G,
    # strides
    stride_ag, stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_cg, stride_cm, stride_cn,
    # constexpr
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # c = sum over chunks q = 0, 1, ... (in order, from 0.0) of chunk q's product, itself the MMAs of its
    # K_CHUNK / BLOCK_K steps accumulated from 0. SPLIT: program (n, m, g * n_chunks + q) computes chunk q alone and
    # stores it (fp32); _chunk_sum_kernel adds the chunks in the same order. Else one program walks every chunk.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if SPLIT:
        g = (tl.program_id(2) // n_chunks).to(tl.int64)
        q_lo = tl.program_id(2) % n_chunks
        q_hi = q_lo + 1
    else:
        g = tl.program_id(2).to(tl.int64)
        q_lo = 0
        q_hi = n_chunks
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + g * stride_ag + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + g * stride_bg + offs_n.to(tl.int64)[None, :] * stride_bn
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for q in range(q_lo, q_hi):
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(q * K_CHUNK, tl.minimum(K, (q + 1) * K_CHUNK), BLOCK_K):  # the chunk's BLOCK_K steps in order
            k_mask = (k0 + offs_k) < K
            a = tl.load(a_rows + (k0 + offs_k)[None, :] * stride_ak, mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)  # fmt: skip
            b = tl.load(b_cols + (k0 + offs_k)[:, None] * stride_bk, mask=k_mask[:, None] & n_mask[None, :],
                        other=0.0)  # fmt: skip
            acc = row_mma_acc(a, b, acc, UPCAST, INPUT_PRECISION)  # the MMA accumulates into acc
        total += acc
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        rows = (q_lo * G + g) * M + offs_m.to(tl.int64)  # [C, G, M] flattened
        tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], total, mask=mask)
    else:
        dst = c_ptr + g * stride_cg + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(dst, total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_sum_kernel(
    part_ptr, c_ptr, M, N, n_chunks, G, stride_cg, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """c[g] = sum over q = 0, 1, ... of part[q, g] from 0.0, in that order (the unsplit kernel's sum), then rounded."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(2).to(tl.int64)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for q in range(0, n_chunks):
        rows = (q * G + g) * M + offs_m.to(tl.int64)
        total += tl.load(part_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    dst = c_ptr + g * stride_cg + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(dst, total.to(c_ptr.dtype.element_ty), mask=mask)


def invariant_bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [G, M, K] @ b [G, K, N] -> [G, M, N] in a's dtype (out: a [G, M, N] tensor or view to store into; any
    strides). The tile is matmul_tile(a.dtype, M); K is summed in K_CHUNK chunks, in order, at every M; a product of
    fewer than SPLIT_BELOW tiles and several chunks runs one program a chunk and a chunk sum (split_k)."""
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
    tile = matmul_tile(a.dtype, m, a.is_cuda)
    chunks = max(1, triton.cdiv(k, K_CHUNK))
    tiles = (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m))
    split = split_k(tiles[0] * tiles[1] * g, chunks)
    part = torch.empty((chunks, g, m, n), dtype=torch.float32, device=a.device) if split else out
    _invariant_matmul_kernel[(*tiles, g * chunks if split else g)](
        a, b, out, part, m, n, k, chunks, g,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, K_CHUNK=K_CHUNK, SPLIT=split,
        UPCAST=not a.is_cuda, INPUT_PRECISION=dot_precision(a.dtype == torch.float32), num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )  # fmt: skip
    if split:
        _chunk_sum_kernel[(triton.cdiv(n, 64), triton.cdiv(m, 16), g)](
            part, out, m, n, chunks, g, out.stride(0), out.stride(1), out.stride(2), BLOCK_M=16, BLOCK_N=64,
            num_warps=4,
        )  # fmt: skip
    return out


def split_k(programs: int, chunks: int) -> bool:
    """Whether a product of `programs` output tiles and `chunks` K chunks runs a program a chunk: below SPLIT_BELOW
    tiles (a decode GEMM: N / 64 of them at M <= 64) the GPU would idle. The bits are the same either way."""
    return chunks > 1 and programs < SPLIT_BELOW


def invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, In] @ w [Out, In]^T -> [T, Out] in x's dtype: a linear's product, batch-invariant (F.linear's contract)."""
    require(x.dim() == 2 and w.dim() == 2 and w.shape[1] == x.shape[1],
            f"x {tuple(x.shape)} and w {tuple(w.shape)} are not [T, In], [Out, In]")  # fmt: skip
    return invariant_bmm(x.unsqueeze(0), w.t().unsqueeze(0))[0]


def invariant_bmm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The twin: fp32 torch.bmm rounded to a's dtype ([G, M, K] @ [G, K, N] -> [G, M, N]); equal up to fp32 order."""
    return torch.bmm(a.float(), b.float()).to(a.dtype)
