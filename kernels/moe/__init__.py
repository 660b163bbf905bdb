"""Fused MoE: the grouped path (align, grouped GEMMs, sum) and the gemv decode path."""

from r3trace.kernels.moe.config import AlignTile, GemmTile, GemvTile, MoeConfig, grouped_config, moe_config
from r3trace.kernels.moe.fused_moe import fused_moe, fused_moe_ref, moe_sum

__all__ = [
    "AlignTile", "GemmTile", "GemvTile", "MoeConfig", "fused_moe", "fused_moe_ref", "grouped_config", "moe_config",
    "moe_sum",
]  # fmt: skip
