"""Random MoE inputs shared by the fused MoE tests (CPU interpreter and GPU files). Their routes come from
bench/inputs.py's `routes`, which bench/moe_verify_tiles.py draws its routes with too."""

from __future__ import annotations

import torch

from bench.inputs import routes

__all__ = ["moe_case", "routes"]  # routes: bench/inputs.py's, imported from here by the fused MoE tests


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
