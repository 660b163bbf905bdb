"""Tiny random DeepSeek-V2/V3 checkpoints written by transformers' save_pretrained, and a direct forward.

Shared by bench scripts (bench/engine_gpu.py) and the engine, capture, server, spec, samples and kernel tests; it
lives in bench/ because bench scripts must not depend on tests/ (tests may import bench).

Each config exercises a different part of the spec: q_lora_rank null, softmax + greedy, sigmoid + noaux_tc with
groups, several dense first layers, norm_topk_prob false, routed_scaling_factor != 1, YaRN scaling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from r3trace.capture.recorder import ListRecorder
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.model import DeepseekForCausalLM, build_model
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.weights import load_weights

_BASE: dict[str, Any] = dict(
    vocab_size=320, hidden_size=48, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=12, max_position_embeddings=256, initializer_range=0.1,
    bos_token_id=0, eos_token_id=1,
)

# name -> (architecture, overrides)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "v3_noaux_groups": ("v3", dict(n_group=4, topk_group=2, num_experts_per_tok=3)),
    "v3_qproj_nonorm": ("v3", dict(q_lora_rank=None, norm_topk_prob=False, routed_scaling_factor=1.7,
                                   n_group=2, topk_group=1)),
    "v3_dense2_yarn": ("v3", dict(first_k_dense_replace=2, num_hidden_layers=4, n_group=2, topk_group=2,
                                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                       original_max_position_embeddings=64, beta_fast=32.0,
                                                       beta_slow=1.0, mscale=0.9, mscale_all_dim=1.0))),
    "v2_softmax_greedy": ("v2", dict(q_lora_rank=None, topk_method="greedy", norm_topk_prob=False)),
    "v2_group_limited": ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                    routed_scaling_factor=2.0, first_k_dense_replace=0, norm_topk_prob=False)),
}


def hf_config(name: str, **overrides: Any) -> Any:
    """transformers' DeepseekV2Config / DeepseekV3Config of a tiny config."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    arch, extra = CONFIGS[name]
    kwargs = {**_BASE, **extra, **overrides}
    if arch == "v3":
        return DeepseekV3Config(**kwargs)
    kwargs.pop("num_key_value_heads", None)
    return DeepseekV2Config(**kwargs)


def make_checkpoint(out_dir: Path, name: str = "v3_noaux_groups", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random checkpoint (config.json + model.safetensors) and return its folder."""
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    config = hf_config(name, **overrides)
    torch.manual_seed(seed)
    model: DeepseekV2ForCausalLM | DeepseekV3ForCausalLM
    if CONFIGS[name][0] == "v3":
        model = DeepseekV3ForCausalLM(config)
        with torch.no_grad():  # a non-zero correction bias, so noaux_tc's bias path is exercised
            for name_, buf in model.named_buffers():
                if name_.endswith("e_score_correction_bias"):
                    buf.normal_(0.0, 0.05)
    else:
        model = DeepseekV2ForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


def load_hf(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def load_engine_model(
    model_dir: Path,
    recorder: ListRecorder | None = None,
    parallel: ParallelInfo | None = None,
    deterministic: bool = False,
    **engine_options: Any,
) -> DeepseekForCausalLM:
    """build_model + load_weights; parallel: this rank's ParallelInfo (None: one process); deterministic: exact
    mode (EngineConfig.deterministic: batch-invariant ops, exact all-reduce)."""
    ecfg = EngineConfig(deterministic=deterministic, **engine_options)
    model = build_model(ModelConfig.from_hf(model_dir), ecfg, parallel or ParallelInfo(), recorder or ListRecorder())
    load_weights(model, model_dir)
    return model


def direct_forward(
    model: DeepseekForCausalLM, token_ids: list[int]
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One prefix-free forward of a whole sequence: (logits [T, V] fp32, {layer_id: topk_ids [T, K]})."""
    cfg = model.config
    n = len(token_ids)
    device = model.engine_config.device
    kv = torch.zeros(cfg.num_hidden_layers, n, cfg.kv_cache_dim, dtype=model.engine_config.torch_dtype, device=device)
    r2t = torch.arange(n, dtype=torch.int32, device=device).unsqueeze(0)
    fb = ForwardBatch.build(
        forward_id=0, input_ids=token_ids, prefix_lens=[0], extend_lens=[n], req_pool_indices=[0],
        out_cache_loc=r2t[0], req_to_token=r2t, logits_rows=list(range(n)), device=device,
    )
    recorder = model.recorder
    assert isinstance(recorder, ListRecorder), "direct_forward reads routes from a ListRecorder"
    logits = model(fb, kv)
    return logits, {layer: ids for layer, (ids, _) in recorder.routes.items()}
