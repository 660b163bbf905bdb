"""The throughput part's models: random DeepSeek-V3-shaped checkpoints (bench/random_checkpoint.py), written once
per run on the GPU (seconds) into a folder outside the result directory, and a one-line summary of each shape."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.random_checkpoint import write_random_checkpoint


def random_checkpoint(folder: Path, shape: str) -> Path:
    """folder/shape, written unless it holds a checkpoint already; drawn on the GPU when there is one."""
    out = folder / shape
    if (out / "config.json").exists():
        return out
    return write_random_checkpoint(out, shape, "cuda" if torch.cuda.is_available() else "cpu")


def shape_summary(ckpt: Path) -> str:
    """'D 2048, 12 layers (11 MoE), E 64 top-6 (8 groups, 4 kept), I 512, 16 heads, vocab 32000, 2.6B parameters'"""
    c = json.loads((ckpt / "config.json").read_text())
    from bench.random_checkpoint import tensor_shapes

    params = sum(int(torch.Size(s).numel()) for _, s in tensor_shapes(c))
    moe = c["num_hidden_layers"] - c["first_k_dense_replace"]
    return (f"D {c['hidden_size']}, {c['num_hidden_layers']} layers ({moe} MoE), E {c['n_routed_experts']} "
            f"top-{c['num_experts_per_tok']} ({c['n_group']} groups, {c['topk_group']} kept), I "
            f"{c['moe_intermediate_size']}, {c['num_attention_heads']} heads, vocab {c['vocab_size']}, "
            + (f"{params / 1e9:.1f}B parameters" if params >= 1e9 else f"{params / 1e6:.1f}M parameters"))
