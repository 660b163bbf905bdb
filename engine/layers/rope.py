"""Rotary embedding over interleaved pairs (x0, x1), (x2, x3), ... with DeepSeek's YaRN.

YaRN (DeepSeek's definition, also transformers'): frequencies blend interpolation (divided by `factor`)
and extrapolation over a linear ramp between the correction dims of beta_fast and beta_slow; cos/sin
are multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim). The matching softmax-scale
term lives in ModelConfig.softmax_scale.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from r3trace.kernels.rope import rope, rope_ref

from ..model_config import ModelConfig, RopeScaling, yarn_mscale


def _yarn_inv_freq(dim: int, base: float, rs: RopeScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rs.factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extrapolation = 1 - ramp
    return interpolation * (1 - keep_extrapolation) + extrapolation * keep_extrapolation


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for positions 0..max_positions-1: cos_sin [P, rope/2, 2] fp32."""

    def __init__(
        self, cfg: ModelConfig, max_positions: int, device: torch.device | str, backend: str = "ref"
    ) -> None:
        super().__init__()
        dim = cfg.qk_rope_head_dim
        if cfg.rope_scaling is None:
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            attn_factor = 1.0
        else:
            rs = cfg.rope_scaling
            inv_freq = _yarn_inv_freq(dim, cfg.rope_theta, rs)
            attn_factor = yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, rope/2]
        self.max_positions = max_positions
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", (freqs.cos() * attn_factor).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attn_factor).to(device), persistent=False)
        self.backend = backend
        self._fn = rope if backend == "triton" else rope_ref  # r3trace.kernels.rope: one launch vs ~12

    def forward(self, positions: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, ..., rope] (pairs interleaved) rotated by positions: [T]; computed in fp32. out: where to write
        it (x's shape, e.g. the rope columns of a wider buffer), else a new tensor."""
        return self._fn(x, positions, self.cos, self.sin, out)
