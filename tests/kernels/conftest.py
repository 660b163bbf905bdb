"""Shared pieces of the kernel tests: device choice, the tolerance table, poisoning, paged caches (built by
bench/inputs.py, the builder the bench scripts use too).

Triton kernels run on CPU only under its interpreter (TRITON_INTERPRET=1, set by `make test`); on a
CUDA machine without that variable they run compiled on the GPU. DEVICE is whichever of the two this
process can run, and every test that is not marked `gpu` runs on it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from bench.inputs import paged_req_to_token

__all__ = ["paged_req_to_token"]  # the bench's builder (bench/inputs.py): the kernel tests' paged caches

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRET or not HAS_CUDA else "cuda"
RUNNABLE = INTERPRET or HAS_CUDA

requires_triton = pytest.mark.skipif(not RUNNABLE, reason="needs TRITON_INTERPRET=1 (CPU) or a CUDA device")
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA, compiled (no interpreter)")
# the Gluon decode kernels (wgmma, TMA, thread-block clusters) are sm_90 only
HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9

# dtype -> (atol, rtol, normwise limit on ||out - ref|| / ||ref||, why). The reference runs in fp32 on the
# same (already rounded) inputs, so the error is the kernel's own: its roundings and summation order.
TOLERANCES: dict[torch.dtype, tuple[float, float, float, str]] = {
    torch.float32: (
        1e-4, 1e-4, 1e-5,
        "fp32 operands, ieee dots (no tf32): only summation order differs; 1e-6 seen on sums of ~100 terms",
    ),
    torch.float16: (
        4e-3, 4e-3, 2e-3,
        "output rounded to fp16 (rel 2^-11) after probabilities/activations were rounded to fp16 for the "
        "second product: a few fp16 ulps of values up to ~4",
    ),
    torch.bfloat16: (
        3e-2, 2e-2, 1e-2,
        "output rounded to bf16 (rel 2^-8 = 3.9e-3) after probabilities/activations were rounded to bf16 "
        "for the second product: 2-3 bf16 ulps of values up to ~4 (0.029 seen at |ref| = 3)",
    ),
}  # fmt: skip


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Every element written (no NaN poison left), elementwise within the table, and normwise."""
    atol, rtol, norm_limit, why = TOLERANCES[dtype]
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), "NaN in the output: an element left unwritten (poison) or overflow"
    torch.testing.assert_close(out64, ref64, atol=atol, rtol=rtol, msg=lambda m: f"{m}\n[{dtype}: {why}]")
    rel = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    assert rel < norm_limit, f"normwise error {rel:.2e} >= {norm_limit:.0e} for {dtype} ({why})"


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch.empty returns NaN-filled floats and -77777-filled ints during the test, so any element a
    kernel leaves unwritten (in its output or an intermediate it later reads) shows up. A patch, not a
    mock: the real allocation happens, only its contents are made hostile."""
    real_empty = torch.empty

    def hostile_empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = real_empty(*args, **kwargs)  # type: ignore[call-overload]
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype not in (torch.bool, torch.uint8):
            t.fill_(-77777)
        return t

    monkeypatch.setattr(torch, "empty", hostile_empty)
    yield


def assert_graph_replay_matches_eager(tile: Any, heads: int) -> None:
    """A captured mla_decode call, replayed on new lengths and new cache contents, equals an eager call on them (the
    Gluon kernels' TMA descriptors are captured as launch arguments; the cache is 64-slot pages either way)."""
    from r3trace.kernels.mla_decode import mla_decode

    gen = torch.Generator().manual_seed(3)
    lens = [900, 17, 2100]
    r2t, rows, S = paged_req_to_token([max(lens)] * 3, 64, gen)
    q = torch.randn(3, heads, 576, generator=gen).cuda().bfloat16()
    kv = torch.randn(S, 576, generator=gen).cuda().bfloat16()
    seq = torch.tensor(lens, device="cuda")
    r2t, rows = r2t.cuda(), rows.cuda()
    mla_decode(q, kv, r2t, rows, seq, 512, 0.05, num_kv_splits=4, tile=tile)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q, kv, r2t, rows, seq, 512, 0.05, num_kv_splits=4, tile=tile)
    seq.copy_(torch.tensor([1, 2049, 64]))
    kv.copy_(torch.randn(S, 576, generator=gen).bfloat16())
    graph.replay()
    eager = mla_decode(q, kv, r2t, rows, seq, 512, 0.05, num_kv_splits=4, tile=tile)
    assert torch.equal(out, eager)
