"""The model's matrix products, one implementation chosen at construction (EngineConfig.matmul_impl).

| impl      | linear (x [T, In], w [Out, In] -> [T, Out])   | per-head (x [T, H, In], w [H, In, Out] -> [T, H, Out]) |
| --------- | --------------------------------------------- | ------------------------------------------------------- |
| torch     | F.linear (cuBLAS: its algorithm follows T)    | torch.bmm                                               |
| invariant | kernels/invariant_matmul.py: one Triton tile  | the same kernel over H batched products                 |
|           | for every T (batch_invariant=True)            |                                                         |
| exact     | exact.py's exact_linear: a fixed fp32 tree    | exact_head_linear                                       |
|           | over 8 / shards blocks (deterministic=True)   |                                                         |

The per-head products are the absorbed MLA's w_kc and w_vc; the linears every ColumnParallel / RowParallel one
(attention projections, the dense and shared MLPs, the MTP draft's eh_proj, the lm_head).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F

from r3trace.kernels.invariant_matmul import invariant_bmm, invariant_linear

from .exact import EXACT_BLOCKS, ExactModeError, check_blocks, exact_head_linear, exact_linear

MatmulImpl = Literal["torch", "invariant", "exact"]
MatmulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [T, In], w [Out, In]) -> [T, Out]
# (x [T, H, In], w [H, In, Out], out [T, H, Out] (a view to store into)) -> None
HeadMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def make_matmul(impl: MatmulImpl, in_f: int, shards: int = 1) -> MatmulFn:
    """A linear's matmul, chosen once at construction. exact: exact_linear on the 8 / shards blocks of this rank's
    in_f inputs (checked here, so a size exact mode cannot split fails when the model is built)."""
    if impl == "torch":
        return F.linear
    if impl == "invariant":
        return invariant_linear
    if shards not in (1, 2, 4, 8):
        raise ExactModeError(f"exact mode splits reductions over 1, 2, 4 or 8 ranks, not {shards}")
    blocks = EXACT_BLOCKS // shards
    check_blocks(in_f, blocks, "linear")
    return partial(exact_linear, blocks=blocks)


def _head_bmm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))


def _head_invariant(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    invariant_bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))  # strided views: no copies


def _head_exact(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(exact_head_linear(x, w.transpose(1, 2)))


def make_head_matmul(impl: MatmulImpl) -> HeadMatmul:
    """The absorbed MLA's per-head product for impl (see the table)."""
    return {"torch": _head_bmm, "invariant": _head_invariant, "exact": _head_exact}[impl]
