"""router_logits (Triton) against router_logits_ref (transformers' F.linear(x.float(), weight)).

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_router_gemm.py -q   (CPU)
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.router_gemm import RouterTile, router_logits, router_logits_ref
from r3trace.kernels.topk import grouped_topk_ref
from tests.kernels.conftest import DEVICE, gpu, requires_gpu, requires_triton

pytestmark = requires_triton


def _case(t: int, e: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d + 3, generator=gen).to(dtype)[:, 3:]  # strided rows, as a column slice would be
    w = torch.randn(e, d, generator=gen) / d**0.5
    return x.to(DEVICE), w.to(DEVICE)


def _check(x: torch.Tensor, w: torch.Tensor, tile: RouterTile | None = None) -> None:
    out = router_logits(x, w, tile)
    ref = router_logits_ref(x, w)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # Both sum D fp32 products of the same (exactly converted) operands, in different orders: the error is a
    # few ulps of the sum of |x_d w_d| (~0.8 at these scales: N(0,1) x N(0,1/D) over D terms), so 1e-5 absolute.
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # What the engine needs: the experts the gate picks are the reference's (tie-free: continuous random inputs)
    args = (None, min(6, w.shape[0]), "softmax", "greedy", 1, 1, False, 1.0)
    assert torch.equal(grouped_topk_ref(out, *args)[1], grouped_topk_ref(ref, *args)[1])


@pytest.mark.parametrize("t,e,d", [(1, 8, 40), (7, 20, 130), (33, 64, 256), (64, 64, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_logits_match_ref(t: int, e: int, d: int, dtype: torch.dtype, poisoned_empty: None) -> None:
    _check(*_case(t, e, d, dtype, seed=t * 7 + e))


@pytest.mark.parametrize("tile", [RouterTile(32, 16, 64, 4, 2), RouterTile(16, 32, 16, 2, 1)])
def test_router_logits_other_tiles(tile: RouterTile, poisoned_empty: None) -> None:
    _check(*_case(45, 37, 100, torch.bfloat16, seed=5), tile)


def test_router_logits_rejects_bad_arguments() -> None:
    x, w = _case(4, 8, 16, torch.bfloat16, seed=1)
    with pytest.raises(KernelInputError, match="weight dtype"):
        router_logits(x, w.to(torch.bfloat16))
    with pytest.raises(KernelInputError, match="features"):
        router_logits(x, w[:, :8].contiguous())
    with pytest.raises(KernelInputError, match="tl.dot"):
        router_logits(x, w, RouterTile(8, 16, 16))


@gpu
@requires_gpu
@pytest.mark.parametrize("t,e,d", [(1, 64, 2048), (64, 64, 2048), (256, 256, 7168), (37, 20, 130)])
def test_router_logits_gpu(t: int, e: int, d: int) -> None:
    _check(*_case(t, e, d, torch.bfloat16, seed=t + e))
