"""Dense SwiGLU MLP (first_k_dense_replace layers and the shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _linear(in_f: int, out_f: int, dtype: torch.dtype, device: torch.device | str) -> nn.Linear:
    layer = nn.Linear(in_f, out_f, bias=False, dtype=dtype, device=device)
    layer.weight.requires_grad_(False)
    return layer


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate, dtype, device)
        self.up_proj = _linear(hidden, intermediate, dtype, device)
        self.down_proj = _linear(intermediate, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


linear = _linear
