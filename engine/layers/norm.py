"""RMSNorm as DeepSeek and transformers compute it: normalise in fp32, cast back, then scale.

The implementation (torch `ref` or fused `triton`, r3trace.kernels.rmsnorm) is chosen at construction.
"""

from __future__ import annotations

import torch
from torch import nn

from r3trace.kernels.rmsnorm import rmsnorm, rmsnorm_ref


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str, backend: str = "ref"
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self._fn = rmsnorm if backend == "triton" else rmsnorm_ref

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]."""
        return self._fn(x, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) [T, D] -> (norm(x + residual), x + residual): the add fused into the norm's launch."""
        return self._fn(x, self.weight, self.eps, residual)
