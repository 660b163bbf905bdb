"""The engine against transformers' DeepseekV2/V3ForCausalLM on tiny random checkpoints.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_hf_equivalence.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.tiny_models import CONFIGS, direct_forward, load_engine_model, load_hf, make_checkpoint
from r3trace.engine.layers.router import RoutingParams, grouped_topk_ref

# fp32 end to end; measured worst case over these configs and both MLA paths: 3.3e-6 (torch 2.13 CPU,
# v3_dense2_yarn).
# 1e-4 leaves room for BLAS reduction-order differences on other CPUs.
LOGPROB_ATOL = 1e-4


def _hf_routes(hf: torch.nn.Module, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Top-k ids of every transformers gate, read with forward hooks: {layer_id: [T, K]}."""
    routes: dict[int, torch.Tensor] = {}
    hooks = []
    for layer_id, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue

        def hook(_m: torch.nn.Module, _inp: object, out: tuple[torch.Tensor, ...], layer_id: int = layer_id) -> None:
            routes[layer_id] = out[2].detach().clone()

        hooks.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        hf(ids)
    for h in hooks:
        h.remove()
    return routes


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("mla_path", ["normal", "absorb"])
def test_logprobs_and_expert_ids_match_transformers(tmp_path: Path, name: str, mla_path: str) -> None:
    ckpt = make_checkpoint(tmp_path / name, name, seed=7)
    hf = load_hf(ckpt)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(2, 320, (1, 29), generator=gen)
    with torch.no_grad():
        ref_logprobs = hf(tokens).logits[0].float().log_softmax(-1)
    hf_routes = _hf_routes(hf, tokens)

    model = load_engine_model(ckpt, mla_path=mla_path)
    logits, routes = direct_forward(model, tokens[0].tolist())
    worst = (logits.log_softmax(-1) - ref_logprobs).abs().max().item()
    assert worst < LOGPROB_ATOL, f"{name}/{mla_path}: worst logprob difference {worst:.2e}"

    cfg = model.config
    assert sorted(routes) == list(cfg.moe_layer_ids) == sorted(hf_routes)
    for layer_id in cfg.moe_layer_ids:
        ours = routes[layer_id].long().sort(dim=-1).values
        theirs = hf_routes[layer_id].long().sort(dim=-1).values
        mismatched = (ours != theirs).any(dim=-1).sum().item()
        assert mismatched == 0, f"{name} layer {layer_id}: {mismatched} tokens with a different expert set"


def test_group_mask_is_minus_inf_not_zero() -> None:
    """DeepSeek's inference code masks dropped groups with -inf; masking with 0.0 (DeepSeek's V3 HF port)
    lets an expert of a dropped group win whenever the biased scores of the kept groups are negative."""
    p = RoutingParams(top_k=3, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
                      norm_topk_prob=True, routed_scaling_factor=1.0)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 16, generator=gen)
    bias = torch.full((16,), -2.0)  # sigmoid <= 1, so every biased choice score is negative
    _, ids_inf = grouped_topk_ref(logits, bias, p, mask_value="-inf")
    _, ids_zero = grouped_topk_ref(logits, bias, p, mask_value="zero")

    scores = logits.sigmoid() + bias
    group_scores = scores.view(64, 4, 4).topk(2, dim=-1).values.sum(-1)
    kept = group_scores.topk(2, dim=-1).indices  # [T, 2]
    in_kept = (ids_inf.long().unsqueeze(-1) // 4 == kept.unsqueeze(1)).any(-1)
    assert in_kept.all(), "-inf masking must only pick experts of the kept groups"
    zero_in_kept = (ids_zero.long().unsqueeze(-1) // 4 == kept.unsqueeze(1)).any(-1)
    assert not zero_in_kept.all(), "0.0 masking picks dropped-group experts on this input"


def test_transformers_v3_gate_agrees_with_minus_inf_semantics(tmp_path: Path) -> None:
    """Pin which semantics the installed transformers V3 gate follows, so a change upstream shows here."""
    ckpt = make_checkpoint(tmp_path / "m", "v3_noaux_groups", seed=5)
    hf = load_hf(ckpt)
    gate = hf.model.layers[1].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.fill_(-2.0)
        x = torch.randn(40, gate.hidden_dim, generator=torch.Generator().manual_seed(5))
        _, _, hf_ids = gate(x)
    p = RoutingParams(top_k=gate.top_k, scoring_func="sigmoid", topk_method="noaux_tc", n_group=gate.num_group,
                      topk_group=gate.topk_group, norm_topk_prob=True, routed_scaling_factor=1.0)
    logits = torch.nn.functional.linear(x, gate.weight.float())
    _, ids_inf = grouped_topk_ref(logits, gate.e_score_correction_bias, p, "-inf")
    _, ids_zero = grouped_topk_ref(logits, gate.e_score_correction_bias, p, "zero")
    hf_sets = hf_ids.sort(-1).values
    same_inf = torch.equal(hf_sets, ids_inf.long().sort(-1).values)
    same_zero = torch.equal(hf_sets, ids_zero.long().sort(-1).values)
    assert same_inf != same_zero, "the input must separate the two semantics"
    # transformers 5.x follows DeepSeek's -inf; if this flips, our engine still follows DeepSeek.
    assert same_inf, "installed transformers masks dropped groups with 0.0; the engine keeps -inf"
