"""Dense SwiGLU MLP (first_k_dense_replace layers and the shared experts).

Under tensor parallelism (tp_size R > 1) the intermediate I is split: gate_proj and up_proj are
column-parallel (I / R rows each), down_proj row-parallel, so forward returns this rank's partial sum
[T, D]; LayerCommunicator.postprocess_layer all-reduces it. exact=True (chosen at construction): exact.py's
exact_linear for the three and a position-free SiLU, so the row-parallel partials combine bitwise under the
exact all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .exact import exact_silu
from .linear import ColumnParallelLinear, RowParallelLinear


def _linear(in_f: int, out_f: int, dtype: torch.dtype, device: torch.device | str) -> nn.Linear:
    layer = nn.Linear(in_f, out_f, bias=False, dtype=dtype, device=device)
    layer.weight.requires_grad_(False)
    return layer


class MLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_rank: int = 0,
        tp_size: int = 1,
        exact: bool = False,
    ) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, tp_rank, tp_size, dtype, device, exact)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, tp_rank, tp_size, dtype, device, exact)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp_rank, tp_size, dtype, device, exact)
        self._act = exact_silu if exact else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D], partial over the TP ranks when tp_size > 1."""
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))


linear = _linear
