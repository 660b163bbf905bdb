"""ModelConfig.from_hf and load_weights: every bad input is one clear error naming what is wrong.

Run: .venv/bin/pytest -q tests/engine/test_config_weights.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.tiny_models import load_engine_model, make_checkpoint
from r3trace.engine.model_config import ConfigError, ModelConfig
from r3trace.engine.weights import WeightsError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ck") / "m", "v3_noaux_groups")


def _rewrite_config(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    raw = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is _DELETE:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


_DELETE = object()


def test_from_hf_reads_every_field(ckpt: Path) -> None:
    cfg = ModelConfig.from_hf(ckpt)
    assert cfg.model_type == "deepseek_v3" and cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid"
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (4, 2, 3)
    assert cfg.moe_layer_ids == (1, 2) and cfg.kv_cache_dim == 16 + 4
    assert cfg.eos_token_ids == (1,) and cfg.rope_scaling is None


def test_v4_style_rope_scaling_and_yarn_fields(ckpt: Path, tmp_path: Path) -> None:
    d = _rewrite_config(ckpt, tmp_path / "y", rope_parameters=_DELETE, rope_theta=5000.0,
                        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    cfg = ModelConfig.from_hf(d)
    assert cfg.rope_theta == 5000.0 and cfg.rope_scaling is not None and cfg.rope_scaling.factor == 40
    # DeepSeek: softmax_scale = qk_head_dim^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2
    expected = cfg.qk_head_dim ** -0.5 * (0.1 * math.log(40.0) + 1) ** 2
    assert abs(cfg.softmax_scale - expected) < 1e-9


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"model_type": "llama"}, "model_type='llama'"),
        ({"kv_lora_rank": _DELETE}, "kv_lora_rank is missing"),
        ({"topk_method": "random"}, "topk_method='random'"),
        ({"scoring_func": "relu"}, "scoring_func='relu'"),
        ({"n_group": 3}, "n_group=3 does not divide n_routed_experts=8"),
        ({"topk_group": 9}, "topk_group=9 exceeds n_group=4"),
        ({"num_experts_per_tok": 12}, "num_experts_per_tok=12 exceeds n_routed_experts=8"),
        ({"first_k_dense_replace": 7}, "first_k_dense_replace=7 outside 0..3"),
        ({"qk_rope_head_dim": 5}, "qk_rope_head_dim=5"),
        ({"hidden_size": -4}, "hidden_size=-4"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "only yarn"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "original_max_position_embeddings is missing"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ],
)
def test_bad_config_names_the_field(ckpt: Path, tmp_path: Path, changes: dict, needle: str) -> None:
    d = _rewrite_config(ckpt, tmp_path / "bad", **changes)
    with pytest.raises(ConfigError, match=None) as info:
        ModelConfig.from_hf(d)
    assert needle in str(info.value)


def test_weights_errors_are_listed_together(ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "w"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.0.self_attn.o_proj.weight"]  # missing
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]  # missing expert part
    tensors["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)  # shape mismatch
    tensors["model.layers.0.mlp.surprise.weight"] = torch.zeros(2)  # unexpected
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightsError) as info:
        load_engine_model(d)
    msg = str(info.value)
    assert "missing: model.layers.0.self_attn.o_proj.weight" in msg
    assert "model.layers.2.mlp.experts: missing 1 tensors" in msg
    assert "kv_b_proj.weight: checkpoint shape (3, 3)" in msg
    assert "unexpected: model.layers.0.mlp.surprise.weight" in msg


def test_sharded_index_and_mtp_layers_kept_aside(ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    gen = torch.Generator().manual_seed(0)
    mtp = {"model.layers.3.eh_proj.weight": torch.randn(48, 96, generator=gen),
           "model.layers.3.enorm.weight": torch.ones(48)}
    shards = {"a.safetensors": {n: tensors[n] for n in names[:half]},
              "b.safetensors": {**{n: tensors[n] for n in names[half:]}, **mtp}}
    weight_map = {}
    for fname, part in shards.items():
        save_file(part, d / fname)
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_engine_model(d)
    assert sorted(model.mtp_weights) == sorted(mtp)
    reference = load_engine_model(ckpt)
    for (n, a), (_, b) in zip(model.named_parameters(), reference.named_parameters(), strict=False):
        assert torch.equal(a, b), n


def test_corrupt_safetensors_is_a_clear_error(ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    raw = (ckpt / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[: len(raw) // 3])
    with pytest.raises(WeightsError, match="model.safetensors"):
        load_engine_model(d)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_runs(ckpt: Path, dtype: str) -> None:
    from bench.tiny_models import direct_forward

    model = load_engine_model(ckpt, dtype=dtype)
    assert model.model.layers[1].mlp.w13.dtype == getattr(torch, dtype)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the gate stays fp32
    logits, routes = direct_forward(model, list(range(5, 30)))
    assert torch.isfinite(logits).all() and set(routes) == {1, 2}
