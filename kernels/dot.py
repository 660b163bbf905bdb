"""The one matrix-product helper every kernel here uses, so the CPU-interpreter workaround lives once.

On CPU, Triton runs only under TRITON_INTERPRET=1, and its interpreter (triton 3.9, interpreter.py
`create_dot`) multiplies bf16 operands as their raw uint16 bit patterns: results off by 1e8. Launchers
pass UPCAST = (tensor is not on CUDA); the operands then go to fp32 before the product, which is what
the GPU's bf16 MMA computes anyway (exact products, fp32 accumulation). On CUDA UPCAST is False and
the product runs on the tensor cores in the operands' dtype.

row_mma is mma for the batch-invariant kernels (EngineConfig.batch_invariant), which promise a row's bits whatever
rows share its tile: in the interpreter it is an explicit multiply and a sum over K in order, not numpy's matmul,
whose OpenBLAS kernels block the rows of A by position (on an AMD EPYC a row's fp32 bits moved by up to 7e-7 with its
row index in the tile). It costs the interpreter several times a matmul, so the other kernels keep mma. On the GPU
the two are one tl.dot.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mma(a, b, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation; INPUT_PRECISION 'ieee' keeps fp32 operands out of tf32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=INPUT_PRECISION)
    else:
        return tl.dot(a, b, input_precision=INPUT_PRECISION)


@triton.jit
def row_mma(a, b, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """mma whose every output row is computed alike in the interpreter too (the module doc says why)."""
    if UPCAST:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, input_precision=INPUT_PRECISION)


@triton.jit
def row_mma_acc(a, b, acc, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc + row_mma(a, b), accumulated inside the MMA on the GPU (tl.dot's acc operand)."""
    if UPCAST:
        return acc + row_mma(a, b, UPCAST, INPUT_PRECISION)
    else:
        return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


def dot_precision(is_fp32: bool) -> str:
    """fp32 operands: 'ieee' (exact, for tests and fp32 tiny models); 16-bit operands ignore it."""
    return "ieee" if is_fp32 else "tf32"
