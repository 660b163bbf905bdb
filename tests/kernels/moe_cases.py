"""Random MoE inputs shared by the fused MoE tests (CPU interpreter and GPU files)."""

from __future__ import annotations

import torch


def routes(T: int, E: int, K: int, gen: torch.Generator, empty: tuple[int, ...] = ()) -> torch.Tensor:
    """Distinct experts per token (as a top-k gives), never the experts in `empty`, some ids -1."""
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(T)])
    off_rank = torch.rand(T, K, generator=gen) < 0.15  # experts on another EP rank
    return torch.where(off_rank, -1, ids).to(torch.int32)


def moe_case(
    T: int, D: int, E: int, I: int, K: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=gen).to(device, dtype)
    w13 = (torch.randn(E, 2 * I, D, generator=gen) / D**0.5).to(device, dtype)
    w2 = (torch.randn(E, D, I, generator=gen) / I**0.5).to(device, dtype)
    ids = routes(T, E, K, gen, empty=(2,)).to(device)
    weights = torch.rand(T, K, generator=gen).to(device)
    return hidden, w13, w2, ids, weights
