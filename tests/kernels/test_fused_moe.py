"""fused_moe (align + two grouped GEMMs + sum) against fused_moe_ref (per-expert torch loop).

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_fused_moe.py -q   (CPU)
     python -m pytest tests/kernels/test_fused_moe.py -q                                (GPU)
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.fused_moe import MoeConfig, fused_moe, fused_moe_ref, moe_align
from tests.kernels.conftest import DEVICE, assert_close_to_ref, gpu, requires_gpu, requires_triton

pytestmark = requires_triton


def _routes(T: int, E: int, K: int, gen: torch.Generator, empty: tuple[int, ...] = ()) -> torch.Tensor:
    """Distinct experts per token (as a top-k gives), never the experts in `empty`, some ids -1."""
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(T)])
    off_rank = torch.rand(T, K, generator=gen) < 0.15  # experts on another EP rank
    return torch.where(off_rank, -1, ids).to(torch.int32)


def _moe_case(
    T: int, D: int, E: int, I: int, K: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=gen).to(device, dtype)
    w13 = (torch.randn(E, 2 * I, D, generator=gen) / D**0.5).to(device, dtype)
    w2 = (torch.randn(E, D, I, generator=gen) / I**0.5).to(device, dtype)
    ids = _routes(T, E, K, gen, empty=(2,)).to(device)
    weights = torch.rand(T, K, generator=gen).to(device)
    return hidden, w13, w2, ids, weights


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_moe_align_invariants(block_m: int) -> None:
    gen = torch.Generator().manual_seed(block_m)
    T, E, K = 29, 9, 3
    ids = _routes(T, E, K, gen, empty=(4,)).to(DEVICE)
    a = moe_align(ids, E, block_m)
    flat = ids.reshape(-1).cpu()
    used = int(a.num_padded.item())
    sorted_ids = a.sorted_ids.cpu()
    assert used % block_m == 0 and used <= sorted_ids.numel()
    real = sorted_ids[:used][sorted_ids[:used] < flat.numel()].long()
    routed = torch.nonzero(flat >= 0).reshape(-1).tolist()
    assert sorted(real.tolist()) == routed, "each routed pair exactly once"
    assert (sorted_ids[used:] == flat.numel()).all(), "past num_padded only padding"
    for blk in range(used // block_m):
        pairs = sorted_ids[blk * block_m : (blk + 1) * block_m].long()
        pairs = pairs[pairs < flat.numel()]
        assert len(pairs) > 0, "no all-padding block before num_padded"
        assert (flat[pairs] == int(a.block_expert[blk])).all(), "one expert per block"
    assert (a.block_expert.cpu()[used // block_m :] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("T", [1, 13])
def test_fused_moe_matches_ref(dtype: torch.dtype, T: int, poisoned_empty: None) -> None:
    hidden, w13, w2, ids, weights = _moe_case(T, 40, 6, 24, 3, dtype, DEVICE, seed=T)  # D, I not pow2
    out = fused_moe(hidden, w13, w2, ids, weights)
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert out.shape == hidden.shape and out.dtype == dtype
    assert_close_to_ref(out, ref, dtype)


@pytest.mark.parametrize(
    "config", [MoeConfig(32, 32, 16, 2, 4, 2), MoeConfig(16, 16, 32, 1, 4, 2)], ids=["bm32-bk16", "bm16-bk32"]
)
def test_fused_moe_tile_configs(config: MoeConfig, poisoned_empty: None) -> None:
    """Tiles that divide D (EVEN_K) and tiles that don't, several M blocks per expert, grouped order."""
    hidden, w13, w2, ids, weights = _moe_case(50, 64, 5, 20, 2, torch.bfloat16, DEVICE, seed=5)
    out = fused_moe(hidden, w13, w2, ids, weights, config=config)
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert_close_to_ref(out, ref, torch.bfloat16)


def test_fused_moe_all_ids_off_rank_gives_zeros() -> None:
    hidden, w13, w2, ids, weights = _moe_case(4, 40, 6, 24, 3, torch.float32, DEVICE, seed=0)
    out = fused_moe(hidden, w13, w2, torch.full_like(ids, -1), weights)
    assert torch.equal(out, torch.zeros_like(out))


def test_fused_moe_rejects_bad_arguments() -> None:
    hidden, w13, w2, ids, weights = _moe_case(4, 40, 6, 24, 3, torch.float32, DEVICE, seed=0)
    with pytest.raises(KernelInputError, match="w2 shape"):
        fused_moe(hidden, w13, w2[:, :, :10].contiguous(), ids, weights)
    with pytest.raises(KernelInputError, match="topk_ids dtype"):
        fused_moe(hidden, w13, w2, ids.long(), weights)
    with pytest.raises(KernelInputError, match="w13 dtype"):
        fused_moe(hidden, w13.half(), w2, ids, weights)


@gpu
@requires_gpu
@pytest.mark.parametrize("T", [1, 200, 700, 3000])  # each of moe_config's four tile tiers at E=32, K=8
def test_fused_moe_deepseek_like_gpu(T: int) -> None:
    hidden, w13, w2, ids, weights = _moe_case(T, 1024, 32, 256, 8, torch.bfloat16, "cuda", seed=T)
    out = fused_moe(hidden, w13, w2, ids, weights)
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert_close_to_ref(out, ref, torch.bfloat16)
