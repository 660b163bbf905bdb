"""latent_write (Triton: kv_a norm + rope + paged cache store in one launch) against latent_write_ref.

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_latent_write.py -q   (CPU)
     python -m pytest tests/kernels/test_latent_write.py -q -m "gpu or not gpu"          (GPU)
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.latent_write import latent_write, latent_write_ref
from tests.kernels.conftest import DEVICE, INTERPRET, gpu, requires_gpu, requires_triton

pytestmark = requires_triton

# The kernel does the reference's fp32 arithmetic on the same rounded inputs (test_rmsnorm_rope.py's
# argument): the norm's 1/rms may differ by a few fp32 ulps (summation order), the rotation by one (fused
# multiply-adds), and each rounding to the output dtype may then land one ulp apart: fp32 2^-23; bf16
# 2^-8 on the GPU, 2^-7 under TRITON_INTERPRET=1 (its fp32 -> bf16 conversion truncates). The norm
# columns are rounded twice (the normalised row, then its product with the weight), the rope columns once;
# the cast to the cache dtype adds nothing when the cache dtype is the input's and one rounding otherwise.
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7 if INTERPRET else 2.0**-8}


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, roundings: int) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    diff = (out.double() - ref.double()).abs()
    bound = 2 * roundings * ULP[dtype] * ref.double().abs() + 1e-6
    assert bool((diff <= bound).all()), f"max excess {(diff - bound).max().item():.3e} for {dtype}"


def _tables(positions: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv) * 1.3  # an mscale-like factor
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


def _slots(t: int, page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """T distinct cache slots: page 1 -> any slots in random order; page 64 -> runs of consecutive slots
    inside shuffled pages (a prefill spanning pages), each run starting at a random offset. Returns (out_cache_loc
    [T] int64, number of slots S, with spare pages no token touches)."""
    if page_size == 1:
        s = 3 * t + 5
        return torch.randperm(s, generator=gen)[:t], s
    n_pages = t // page_size + 4
    pages = torch.randperm(n_pages, generator=gen)
    start = int(torch.randint(0, page_size, (1,), generator=gen))
    flat = pages[:, None] * page_size + torch.arange(page_size)[None, :]  # [pages, 64] slots page by page
    return flat.reshape(-1)[start : start + t], n_pages * page_size


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
])  # fmt: skip
@pytest.mark.parametrize("t,lora,r", [(1, 512, 64), (13, 512, 64), (67, 32, 16), (5, 100, 8)])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("return_latent", [False, True])
def test_latent_write_matches_ref(
    t: int, lora: int, r: int, dtype: torch.dtype, cache_dtype: torch.dtype, page_size: int, return_latent: bool
) -> None:
    gen = torch.Generator().manual_seed(t * 7 + lora + page_size)
    # kv_a is a strided view: kv_a_proj's output as the engine sees it is contiguous, but the kernel takes row
    # strides, so a wider buffer checks that columns past C are never read or written
    wide = (torch.randn(t, lora + r + 24, generator=gen) * 3).to(dtype).to(DEVICE)
    kv_a = wide[:, : lora + r]
    w = (1 + 0.2 * torch.randn(lora, generator=gen)).to(dtype).to(DEVICE)
    cos, sin = _tables(300, r // 2)
    pos = torch.randint(0, 300, (t,), generator=gen).to(DEVICE)
    loc, s = _slots(t, page_size, gen)
    loc = loc.to(DEVICE)
    before = torch.randn(s, lora + r, generator=gen).to(cache_dtype).to(DEVICE)  # stale rows, never zeros
    cache, cache_ref = before.clone(), before.clone()
    lat = latent_write(kv_a, w, 1e-6, pos, cos, sin, loc, cache, return_latent)
    lat_ref = latent_write_ref(kv_a, w, 1e-6, pos, cos, sin, loc, cache_ref, return_latent)
    extra = int(cache_dtype != dtype)
    _close(cache[loc, :lora], cache_ref[loc, :lora], cache_dtype, 2 + extra)
    _close(cache[loc, lora:], cache_ref[loc, lora:], cache_dtype, 1 + extra)
    untouched = torch.ones(s, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.equal(cache[untouched], before[untouched]), "a slot outside out_cache_loc was written"
    if return_latent:
        assert lat is not None and lat_ref is not None
        assert torch.equal(lat, cache[loc]), "latent and the cache rows are the same values"
    else:
        assert lat is None and lat_ref is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_write_equals_the_triton_norm_rope_store(dtype: torch.dtype) -> None:
    """At the model's row (kv_lora 512, rope 64) the kernel does rmsnorm.py's and rope.py's arithmetic in the
    same layout (one warp over 512 values): the cache rows are bit-identical to the unfused triton path's."""
    from r3trace.kernels.rmsnorm import rmsnorm
    from r3trace.kernels.rope import rope

    gen = torch.Generator().manual_seed(17)
    t = 37
    kv_a = (torch.randn(t, 576, generator=gen) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.2 * torch.randn(512, generator=gen)).to(dtype).to(DEVICE)
    cos, sin = _tables(300, 32)
    pos = torch.randint(0, 300, (t,), generator=gen).to(DEVICE)
    loc = torch.randperm(100, generator=gen)[:t].to(DEVICE)
    cache = torch.randn(100, 576, generator=gen).to(dtype).to(DEVICE)
    latent_write(kv_a, w, 1e-6, pos, cos, sin, loc, cache)
    unfused = torch.cat([rmsnorm(kv_a[:, :512], w, 1e-6)[0], rope(kv_a[:, 512:], pos, cos, sin)], dim=-1)
    assert torch.equal(cache[loc], unfused)


def test_latent_write_no_tokens() -> None:
    cos, sin = _tables(4, 8)
    cache = torch.randn(6, 48, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    keep = cache.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    lat = latent_write(torch.empty(0, 48, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6, empty, cos, sin,
                       empty, cache, return_latent=True)
    assert lat is not None and lat.shape == (0, 48) and torch.equal(cache, keep)


def test_latent_write_rejects_bad_arguments() -> None:
    cos, sin = _tables(10, 32)
    kv_a = torch.randn(3, 576, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    w = torch.ones(512, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    loc = torch.arange(3, device=DEVICE)
    cache = torch.zeros(8, 576, device=DEVICE)
    with pytest.raises(KernelInputError, match="out_cache_loc 2 entries"):
        latent_write(kv_a, w, 1e-6, pos, cos, sin, loc[:2], cache)
    with pytest.raises(KernelInputError, match="R=48"):
        latent_write(kv_a, torch.ones(528, device=DEVICE), 1e-6, pos, cos, sin, loc, cache)
    with pytest.raises(KernelInputError, match="kv_cache rows have 575 columns"):
        latent_write(kv_a, w, 1e-6, pos, cos, sin, loc, cache[:, :575])
    with pytest.raises(KernelInputError, match="norm_weight dtype"):
        latent_write(kv_a, w.half(), 1e-6, pos, cos, sin, loc, cache)


@gpu
@requires_gpu
def test_latent_write_under_cuda_graph() -> None:
    """No host syncs: a CUDA graph replays it with new inputs, new positions and new slots."""
    gen = torch.Generator().manual_seed(3)
    cos, sin = _tables(100, 32)
    kv_a = torch.randn(64, 576, generator=gen).to("cuda", torch.bfloat16)
    w = (1 + 0.2 * torch.randn(512, generator=gen)).to("cuda", torch.bfloat16)
    pos = torch.randint(0, 100, (64,), generator=gen).cuda()
    loc = torch.randperm(500, generator=gen)[:64].cuda()
    cache = torch.randn(500, 576, generator=gen).to("cuda", torch.bfloat16)
    latent_write(kv_a, w, 1e-6, pos, cos, sin, loc, cache)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        latent_write(kv_a, w, 1e-6, pos, cos, sin, loc, cache)
    kv_a.copy_(torch.randn(64, 576, generator=gen).to("cuda", torch.bfloat16))
    pos.copy_(torch.randint(0, 100, (64,), generator=gen).cuda())
    loc.copy_(torch.randperm(500, generator=gen)[:64].cuda())
    graph.replay()
    ref = cache.clone()
    latent_write_ref(kv_a, w, 1e-6, pos, cos, sin, loc, ref)
    _close(cache[loc], ref[loc], torch.bfloat16, 2)


def test_latent_write_one_token_slot_from_a_table_column() -> None:
    """One decode token whose slot is the last column of a req_to_token row (bench/capture.py at batch 1:
    `req_to_token[:, -1].long()`): torch keeps the column's stride (the table's width) on a one-element tensor
    and calls it contiguous. A one-element dimension's stride is never used, so the launcher takes it and writes
    the same row as the reference."""
    gen = torch.Generator().manual_seed(5)
    table = torch.randperm(40, generator=gen)[:24].view(1, 24).to(torch.int32).to(DEVICE)  # [B = 1, context]
    loc = table[:, -1].long()
    assert loc.stride() == (24,) and loc.is_contiguous()
    cos, sin = _tables(30, 8)
    kv_a = torch.randn(1, 48, generator=gen).to(DEVICE)
    w = (1 + 0.2 * torch.randn(32, generator=gen)).to(DEVICE)
    pos = torch.tensor([23], device=DEVICE)
    before = torch.randn(40, 48, generator=gen).to(DEVICE)
    cache, cache_ref = before.clone(), before.clone()
    latent_write(kv_a, w, 1e-6, pos, cos, sin, loc, cache)
    latent_write_ref(kv_a, w, 1e-6, pos, cos, sin, loc, cache_ref)
    _close(cache, cache_ref, torch.float32, 2)
    assert not torch.equal(cache, before), "the slot was written"
