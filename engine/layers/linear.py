"""Tensor-parallel linears and the vocab-parallel embedding: each holds only its rank's shard.

Shape legend: T tokens, In / Out the full feature sizes, R ranks of the group sharded over.
- ColumnParallelLinear: weight rows Out / R (its slice of the outputs); output [T, Out / R], complete.
- RowParallelLinear:    weight columns In / R (its slice of the inputs); output [T, Out], a partial sum over
                        its inputs only. The layer does NOT reduce it: the all-reduce sits at the layer
                        boundary (LayerCommunicator), so the math here stays free of collectives.
- VocabParallelEmbedding: rows V / R; ids outside the rank's slice read zeros (the sum over ranks is the
                        lookup), reduced at the model's embed boundary (VocabCommunicator).
Each module reports its Shard, so weights.py copies the rank's slice of the full checkpoint tensor.
The matmul is chosen at construction (matmul.py's table: torch, invariant, or exact, whose row-parallel shard
sums its 8 / R blocks, the subtree the exact all-reduce completes), never per call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .matmul import MatmulImpl, make_matmul


class Shard(NamedTuple):
    """This rank's slice of a weight: along dim, piece rank of size equal pieces."""

    dim: int
    rank: int
    size: int


def _split(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by the {size} tensor-parallel ranks")
    return n // size


def _weight(rows: int, cols: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """Also the replicated linear (rank 0 of size 1): every output is a complete sum over In."""

    def __init__(
        self, in_f: int, out_f: int, rank: int, size: int, dtype: torch.dtype, device: torch.device | str,
        matmul: MatmulImpl = "torch",
    ) -> None:
        super().__init__()
        self.weight = _weight(_split(out_f, size, "out_features"), in_f, dtype, device)
        self.shard = Shard(0, rank, size)
        self._matmul = make_matmul(matmul, in_f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, In] -> [T, Out / R]."""
        return self._matmul(x, self.weight)


class RowParallelLinear(nn.Module):
    def __init__(
        self, in_f: int, out_f: int, rank: int, size: int, dtype: torch.dtype, device: torch.device | str,
        matmul: MatmulImpl = "torch",
    ) -> None:
        super().__init__()
        self.weight = _weight(out_f, _split(in_f, size, "in_features"), dtype, device)
        self.shard = Shard(1, rank, size)
        self._matmul = make_matmul(matmul, self.weight.shape[1], size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, In / R] -> [T, Out], this rank's partial sum (unreduced)."""
        return self._matmul(x, self.weight)


def replicated_linear(
    in_f: int, out_f: int, dtype: torch.dtype, device: torch.device | str, matmul: MatmulImpl = "torch"
) -> ColumnParallelLinear:
    """A whole linear on every rank (the latent projections): a column-parallel one over a single rank."""
    return ColumnParallelLinear(in_f, out_f, 0, 1, dtype, device, matmul)


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, vocab: int, hidden: int, rank: int, size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = _weight(_split(vocab, size, "vocab_size"), hidden, dtype, device)
        self.shard = Shard(0, rank, size)
        self.start = rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] -> [T, D]; rows of ids outside this rank's slice are zeros (a partial sum over ranks)."""
        if self.shard.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


def shards(model: nn.Module) -> dict[str, Shard]:
    """{parameter name: Shard} of every sharded weight of model (weights.py slices the checkpoint by it)."""
    sharded = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    return {
        f"{name}.weight": m.shard
        for name, m in model.named_modules()
        if isinstance(m, sharded) and m.shard.size > 1
    }
