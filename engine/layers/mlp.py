"""Dense SwiGLU MLP (first_k_dense_replace layers and the shared experts).

Under tensor parallelism (tp_size R > 1) the intermediate I is split: gate_proj and up_proj are
column-parallel (I / R rows each), down_proj row-parallel, so forward returns this rank's partial sum
[T, D]; LayerCommunicator.postprocess_layer all-reduces it. matmul (chosen at construction, matmul.py): "exact"
takes exact.py's exact_linear for the three and a position-free SiLU, so the row-parallel partials combine bitwise
under the exact all-reduce; "invariant" the batch-invariant GEMM and the same position-free SiLU (torch's CPU silu
rounds a run's last elements differently: exact.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .exact import exact_silu
from .linear import ColumnParallelLinear, RowParallelLinear
from .matmul import MatmulImpl


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
        matmul: MatmulImpl = "torch",
    ) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, tp_rank, tp_size, dtype, device, matmul)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, tp_rank, tp_size, dtype, device, matmul)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp_rank, tp_size, dtype, device, matmul)
        self._act = F.silu if matmul == "torch" else exact_silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D], partial over the TP ranks when tp_size > 1."""
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))


linear = _linear
