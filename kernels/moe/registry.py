"""The fused MoE's two paths as records, and MoePlan: the choice between them resolved once, when the engine's
MoE backend is built, and shared by every MoE layer.

    record    supported(shape, dtype)                 launcher (one call)                        runs at
    gemv      float dtypes, I > 0                     gemv.py: gate_up gemv, down+sum gemv       T <= gemv_max_tokens(I)
    grouped   float dtypes, any shape                 align, gate_up and down GEMMs, moe_sum     every other T

The path depends on T, known only per call; everything else is fixed when the plan is built: which records run,
the T threshold and the gemv tile of each T <= it. A call then compares T with the threshold and takes the grouped
tiles from grouped_config (host arithmetic on T K / E, no device sync), so forward looks nothing up by name.
MoePlan(T) runs exactly what fused_moe(config=None) runs (moe_config): tests/kernels/test_moe_registry.py.

Batch-invariant plan (resolve_moe(..., invariant=True), EngineConfig.batch_invariant): never gemv, and the grouped
path with the default plan's tiles (config.invariant_config: each GEMM's MMA steps accumulate in K order whatever the
tile), so a pair's products and its token's K-sum (moe_sum, k = 0..K-1) are the same sums in the same order at any T.
The alignment's launch shape, PDL and the tiles follow T: they move pairs between blocks, never a product's reduction
order. fp32 and Triton's CPU interpreter run the decode-size tiles at every T (invariant_config says why; the
interpreter also caps a tensor at 2^20 elements, and row_mma's product there is BLOCK_M x BLOCK_K x BLOCK_N).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from r3trace.kernels.contract import FLOAT_DTYPES, KernelInputError
from r3trace.kernels.moe.config import (
    GemvTile,
    MoeConfig,
    gemv_max_tokens,
    gemv_tile,
    grouped_config,
    invariant_config,
)
from r3trace.kernels.moe.fused_moe import fused_moe


class MoeShape(NamedTuple):
    """What the path choice depends on besides T and dtype: D hidden and I moe_intermediate_size (E and K are read
    from the call's tensors: expert parallelism and fused shared experts change them per rank)."""

    hidden: int
    inter: int


Launch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, MoeConfig], torch.Tensor]


class MoeKernel(NamedTuple):
    name: str
    supported: Callable[[MoeShape, torch.dtype], str | None]  # None: it runs these inputs, else why not
    launch: Launch  # (hidden, w13, w2, topk_ids, topk_weights, config) -> [T, D]


def _float_dtype(dtype: torch.dtype) -> str | None:
    return None if dtype in FLOAT_DTYPES else f"the fused MoE takes {FLOAT_DTYPES}, not {dtype}"


def _gemv_supported(shape: MoeShape, dtype: torch.dtype) -> str | None:
    return _float_dtype(dtype) or (None if shape.inter > 0 else f"the gemv path needs I > 0, got {shape.inter}")


def _launch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor, config: MoeConfig) -> torch.Tensor:
    """fused_moe with an explicit config: its gemv field picks gemv.py, else the grouped pipeline."""
    return fused_moe(hidden, w13, w2, topk_ids, topk_weights, config=config)


GEMV = MoeKernel("gemv", _gemv_supported, _launch)
GROUPED = MoeKernel("grouped", lambda shape, dtype: _float_dtype(dtype), _launch)


@dataclass(frozen=True)
class MoePlan:
    """The fused MoE of one engine: gemv at 1 <= T <= gemv_max_tokens (its tile per T), grouped above. Called as the
    MoE layer's experts function: (hidden [T, D], w13 [E, 2I, D], w2 [E, D, I], topk_ids [T, K], topk_weights
    [T, K]) -> [T, D]."""

    shape: MoeShape
    dtype: torch.dtype
    gemv: MoeKernel | None  # None: the gemv path does not run these inputs
    grouped: MoeKernel
    gemv_max_tokens: int  # T <= this runs gemv (0: never)
    gemv_tiles: tuple[GemvTile, ...]  # [T - 1]: the gemv tile at T
    invariant: bool = False  # the batch-invariant plan (config.invariant_config's tiles, never gemv)

    def config(self, tokens: int, pairs: int, experts: int, compiled: bool = True) -> MoeConfig:
        """The tiles a call of `tokens` rows, `pairs` = T K pairs and `experts` = E rows of w13 runs (compiled=False:
        Triton's CPU interpreter)."""
        grouped = grouped_config(pairs, experts, self.dtype.itemsize, self.shape.inter, self.shape.hidden)
        if self.invariant:
            return invariant_config(grouped, pairs, experts, self.dtype.itemsize, self.shape.inter, self.shape.hidden,
                                    compiled)  # fmt: skip
        if 1 <= tokens <= self.gemv_max_tokens:
            return grouped._replace(gemv=self.gemv_tiles[tokens - 1])
        return grouped

    def __call__(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        cfg = self.config(hidden.shape[0], topk_ids.numel(), w13.shape[0], hidden.is_cuda)
        kernel = self.grouped if cfg.gemv is None else self.gemv
        assert kernel is not None  # gemv_max_tokens is 0 without the gemv record
        return kernel.launch(hidden, w13, w2, topk_ids, topk_weights, cfg)


def resolve_moe(shape: MoeShape, dtype: torch.dtype, invariant: bool = False) -> MoePlan:
    """The plan for these weights: every record asked once; an input no path runs is refused here, in one line.
    invariant: the batch-invariant plan (grouped only, config.invariant_config's tiles)."""
    why = GROUPED.supported(shape, dtype)
    if why is not None:
        raise KernelInputError(why)
    if invariant:
        return MoePlan(shape, dtype, None, GROUPED, 0, (), invariant=True)
    gemv = GEMV if GEMV.supported(shape, dtype) is None else None
    top = gemv_max_tokens(shape.inter) if gemv is not None else 0
    tiles = tuple(gemv_tile(t, shape.inter) for t in range(1, top + 1))
    assert all(t is not None for t in tiles)
    return MoePlan(shape, dtype, gemv, GROUPED, top, tiles)  # type: ignore[arg-type]
