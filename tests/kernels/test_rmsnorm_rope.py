"""rmsnorm and rope (Triton) against their torch references.

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_rmsnorm_rope.py -q   (CPU)
     python -m pytest tests/kernels/test_rmsnorm_rope.py -q -m "gpu or not gpu"          (GPU)
"""

from __future__ import annotations

import math

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from r3trace.kernels.rope import rope, rope_ref
from tests.kernels.conftest import DEVICE, INTERPRET, gpu, requires_gpu, requires_triton

pytestmark = requires_triton

# Both kernels do the reference's fp32 arithmetic on the same rounded inputs. What may differ: the
# order of the mean's sum (RMSNorm: a row's 1/rms a few fp32 ulps off, so a whole row may differ) and
# fused multiply-adds in the rotation (RoPE: 1 fp32 ulp). Each rounding to the output dtype may then
# land one ulp apart: fp32 2^-23; bf16 2^-8 on the GPU (round to nearest), but 2^-7 under
# TRITON_INTERPRET=1, whose fp32 -> bf16 conversion truncates (measured: 50% of random values differ
# from torch's rounding, 100% equal truncation). RMSNorm rounds twice in bf16 (the normalised row,
# then its product with the weight).
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7 if INTERPRET else 2.0**-8}


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, roundings: int = 1) -> None:
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    diff = (out.double() - ref.double()).abs()
    bound = 2 * roundings * ULP[dtype] * ref.double().abs() + 1e-6
    assert bool((diff <= bound).all()), f"max excess {(diff - bound).max().item():.3e} for {dtype}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(1, 64), (7, 512), (33, 1536), (3, 7168), (5, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_ref(t: int, d: int, dtype: torch.dtype, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(t * 131 + d)
    x = (torch.randn(t, d, generator=gen) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype).to(DEVICE)
    res = (torch.randn(t, d, generator=gen) * 2).to(dtype).to(DEVICE) if with_residual else None
    out, r = rmsnorm(x, w, 1e-6, res)
    ref_out, ref_r = rmsnorm_ref(x, w, 1e-6, res)
    # with a residual, the sum is one more rounding (bit-identical where rounding is to nearest)
    _close(out, ref_out, dtype, roundings=3 if with_residual else 2)
    if dtype == torch.float32 or not INTERPRET:
        assert torch.equal(r, ref_r), "the residual sum is one rounded add in both: bit-identical"
    else:
        _close(r, ref_r, dtype)


def test_rmsnorm_strided_rows() -> None:
    """A column slice of a projection's output (c_kv of kv_a_proj: 512 of 576 columns) works in place."""
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(9, 576, generator=gen).to(DEVICE)
    x = full[:, :512]
    w = torch.randn(512, generator=gen).to(DEVICE)
    _close(rmsnorm(x, w, 1e-6)[0], rmsnorm_ref(x, w, 1e-6)[0], torch.float32)


def test_rmsnorm_rejects_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen).to(DEVICE)
    with pytest.raises(KernelInputError, match="weight has 7 features"):
        rmsnorm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(KernelInputError, match="residual shape"):
        rmsnorm(x, torch.ones(8, device=DEVICE), 1e-6, torch.randn(3, 8, generator=gen).to(DEVICE))


def _tables(positions: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv) * 1.3  # an mscale-like factor
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (13, 64), (5, 3, 64), (9, 16, 64), (4, 5, 8)])
def test_rope_matches_ref(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(math.prod(shape))
    r = shape[-1]
    cos, sin = _tables(300, r // 2)
    # q_pe is a strided view: the last 64 of 192 columns of each head
    wide = torch.randn(*shape[:-1], r + 128, generator=gen).to(dtype).to(DEVICE)
    x = wide[..., 128:]
    pos = torch.randint(0, 300, (shape[0],), generator=gen).to(DEVICE)
    _close(rope(x, pos, cos, sin), rope_ref(x, pos, cos, sin), dtype)


@pytest.mark.parametrize("fn", [rope, rope_ref])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_writes_into_a_slice(fn, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """out=: the rope columns of the absorbed query [T, H, kv_lora + R] (a strided slice), other columns kept."""
    gen = torch.Generator().manual_seed(11)
    cos, sin = _tables(50, 32)
    x = torch.randn(7, 3, 192, generator=gen).to(dtype).to(DEVICE)[..., 128:]  # q_pe: a strided view
    pos = torch.randint(0, 50, (7,), generator=gen).to(DEVICE)
    buf = torch.randn(7, 3, 40 + 64, generator=gen).to(dtype).to(DEVICE)
    keep = buf[..., :40].clone()
    got = fn(x, pos, cos, sin, out=buf[..., 40:])
    assert got.data_ptr() == buf[..., 40:].data_ptr()
    _close(buf[..., 40:], rope_ref(x, pos, cos, sin), dtype)
    assert torch.equal(buf[..., :40], keep)
    with pytest.raises(KernelInputError, match="out: shape"):
        fn(x, pos, cos, sin, out=buf[..., 41:])


def test_rope_rejects_bad_arguments() -> None:
    cos, sin = _tables(10, 32)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).to(DEVICE)
    with pytest.raises(KernelInputError, match="positions has 2 entries"):
        rope(x, torch.zeros(2, dtype=torch.int64, device=DEVICE), cos, sin)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(KernelInputError, match="cos has 32 columns, expected R/2=16"):
        rope(torch.randn(3, 32, generator=gen).to(DEVICE), pos, cos, sin)
    with pytest.raises(KernelInputError, match="R=48"):
        rope(torch.randn(3, 48, generator=gen).to(DEVICE), pos, cos, sin)


@gpu
@requires_gpu
def test_rmsnorm_rope_under_cuda_graph() -> None:
    """Both launch without host syncs, so a CUDA graph replays them with new inputs."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 2048, generator=gen).to("cuda", torch.bfloat16)
    res = torch.randn(64, 2048, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(2048, generator=gen).to("cuda", torch.bfloat16)
    cos, sin = _tables(100, 32)
    q = torch.randn(64, 16, 64, generator=gen).to("cuda", torch.bfloat16)
    pos = torch.randint(0, 100, (64,), generator=gen).cuda()
    rmsnorm(x, w, 1e-6, res), rope(q, pos, cos, sin)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, r = rmsnorm(x, w, 1e-6, res)
        q_out = rope(q, pos, cos, sin)
    x.copy_(torch.randn(64, 2048, generator=gen).to("cuda", torch.bfloat16))
    pos.copy_(torch.randint(0, 100, (64,), generator=gen).cuda())
    graph.replay()
    _close(out, rmsnorm_ref(x, w, 1e-6, res)[0], torch.bfloat16, roundings=2)
    _close(q_out, rope_ref(q, pos, cos, sin), torch.bfloat16)
