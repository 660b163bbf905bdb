"""RMSNorm as DeepSeek and transformers compute it: normalise in fp32, cast back, then scale.

The implementation (torch `ref`, fused `triton` (r3trace.kernels.rmsnorm), or `exact`: the mean of squares
through exact.py's tree_sum, batch-invariant) is chosen at construction.
"""

from __future__ import annotations

import torch
from torch import nn

from r3trace.kernels.rmsnorm import rmsnorm, rmsnorm_ref

from .exact import tree_sum


def rmsnorm_exact(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm_ref's contract, the sum of squares a fixed tree (torch's mean picks its order from the shape)."""
    r = x if residual is None else x + residual
    rf = r.float()
    rf = rf * torch.rsqrt(tree_sum(rf * rf, -1).unsqueeze(-1) / rf.shape[-1] + eps)
    return weight * rf.to(r.dtype), r


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str, backend: str = "ref"
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self._fn = {"triton": rmsnorm, "exact": rmsnorm_exact}.get(backend, rmsnorm_ref)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        return self._fn(x, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) [T, D] -> (norm(x + residual), x + residual): the add fused into the norm's launch."""
        return self._fn(x, self.weight, self.eps, residual)
