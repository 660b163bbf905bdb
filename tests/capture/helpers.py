"""Ground truth for capture tests: the routes of a direct forward of a request's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import r3trace
from bench.tiny_models import direct_forward, load_engine_model

_MODELS: dict[Path, Any] = {}


def direct_routes(ckpt: Path, tokens: list[int]) -> np.ndarray:
    """[len(tokens), L, K] int32: row p = routing of position p in one prefix-free forward; -1 dense."""
    if ckpt not in _MODELS:
        _MODELS[ckpt] = load_engine_model(ckpt)
    model = _MODELS[ckpt]
    _, routes = direct_forward(model, tokens)
    cfg = model.config
    out = np.full((len(tokens), cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, np.int32)
    for layer, ids in routes.items():
        out[:, layer] = ids.numpy()
    return out


def returned_routes(result: dict[str, Any]) -> np.ndarray:
    return r3trace.decode_routed_experts(result["meta_info"])


def assert_routes_exact(ckpt: Path, prompt: list[int], result: dict[str, Any], start_len: int = 0) -> None:
    """0 mismatches: every returned id equals the direct forward's, in gate-rank order."""
    got = returned_routes(result)
    seq = prompt + result["output_ids"]
    n_rows = len(seq) - 1 if result["output_ids"] else len(prompt)
    want = direct_routes(ckpt, seq[:n_rows])[start_len:]
    assert got.shape == want.shape, (got.shape, want.shape)
    mismatched = int((got != want).any(axis=(1, 2)).sum())
    assert mismatched == 0, f"{mismatched} of {len(want)} rows differ"
