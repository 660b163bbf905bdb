"""Tiny random DeepSeek-V3 checkpoints with an MTP (NextN) layer, for speculative decoding tests.

transformers' DeepseekV3ForCausalLM does not build the MTP layer, so after save_pretrained the MTP tensors are
added as DeepSeek-V3 stores them (model.layers.{L}.*), built so that the draft agrees with the target often but not
always (a random draft is accepted about once in 60 drafts: no mixed acceptance to test):
- the target has a dense layer 0 whose output projections are zero (the residual stream passes it unchanged) and a
  MoE layer 1, and embedding rows of unit RMS;
- the MTP layer is layer 1 plus seeded noise, eh_proj = [I, 0] (the draft reads enorm(embed(x_{t+1})) ~ embed(x_{t+1})
  and ignores h_t), shared_head.norm = the final norm: the draft at position t then recomputes the target's position
  t + 1 from the tokens after x_0 (its cache holds x_1.. at positions shifted by one, RoPE's relative angles equal);
  missing x_0 and the noise make it disagree now and then.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from bench.tiny_models import make_checkpoint


def add_mtp_layer(ckpt: Path, seed: int = 0, noise: float = 0.05) -> Path:
    """Rewrite ckpt (a 2-layer v3 checkpoint: dense layer 0, MoE layer 1) in place as described above."""
    config = json.loads((ckpt / "config.json").read_text())
    n, d = config["num_hidden_layers"], config["hidden_size"]
    if (n, config["first_k_dense_replace"]) != (2, 1):
        raise ValueError(f"add_mtp_layer wants 2 layers, the first dense; got {n}, {config['first_k_dense_replace']}")
    tensors = load_file(ckpt / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        tensors[name] = torch.zeros_like(tensors[name])
    emb = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = emb / emb.pow(2).mean(dim=1, keepdim=True).sqrt()

    def jitter(t: torch.Tensor) -> torch.Tensor:
        return t + noise * t.abs().mean() * torch.randn(t.shape, generator=gen, dtype=t.dtype)

    last, mtp = "model.layers.1.", f"model.layers.{n}."
    extra = {mtp + k[len(last):]: jitter(v) for k, v in tensors.items() if k.startswith(last)}
    extra[mtp + "enorm.weight"] = torch.ones(d)
    extra[mtp + "hnorm.weight"] = torch.ones(d)
    extra[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    extra[mtp + "eh_proj.weight"] = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)  # [D, 2D]
    extra[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    extra[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **extra}, ckpt / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    return ckpt


def make_mtp_checkpoint(out_dir: Path, seed: int = 0, noise: float = 0.05, **overrides: Any) -> Path:
    """A tiny v3_noaux_groups checkpoint (bench/tiny_models.py) of 2 layers with an MTP layer."""
    ckpt = make_checkpoint(out_dir, "v3_noaux_groups", seed=seed, num_hidden_layers=2, **overrides)
    return add_mtp_layer(ckpt, seed=seed, noise=noise)
