"""r3trace: capture, stream and analyse the routing decisions of DeepSeek-style MoE models."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["decode_routed_experts", "decode_routed_weights"]


def __getattr__(name: str) -> Any:
    # Lazy: `import r3trace` (the CLI, the analysis layer) should not pay for importing torch.
    if name in ("decode_routed_experts", "decode_routed_weights"):
        from .capture import wire

        return getattr(wire, name)
    raise AttributeError(f"module 'r3trace' has no attribute {name!r}")
