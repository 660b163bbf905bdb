"""RoutingParams: one MoE layer's gate settings, and the grouped top-k reference in their terms.

The math is written once, in kernels/topk.py (`grouped_topk_ref` and its parts: DeepSeek's gate in plain
torch, checked against transformers' gates by tests/kernels/test_topk.py). The functions here only unpack
RoutingParams for it: the engine's ref backend, routing replay's weights and replay-check's near-tie margins
call them, so they run the same lines as the reference the Triton kernel is tested against.

Shape legend: T tokens, E routed experts, K top-k, G groups.

scores  = softmax(logits) | sigmoid(logits)                  [T, E]
choice  = scores + e_score_correction_bias (when present)    [T, E]
groups  = max(choice in group)        (group_limited_greedy)
        | sum(top-2 choice in group)  (noaux_tc)             [T, G]
keep the topk_group best groups, mask the others' choice with -inf (DeepSeek's inference code; 0.0,
as some ports use, lets a masked expert beat a negative biased score), then
topk_ids     = top-K of choice, descending (gate-rank order)  [T, K]
topk_weights = scores.gather(topk_ids) (no bias), renormalised when norm_topk_prob, times
               routed_scaling_factor                          [T, K]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from r3trace.kernels import topk as ref
from r3trace.kernels.topk import MaskValue, gate_scores

__all__ = ["MaskValue", "RoutingParams", "gate_scores", "group_masked_choice", "grouped_topk_ref", "weights_for_ids"]


@dataclass(frozen=True)
class RoutingParams:
    top_k: int
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def weights_for_ids(scores: torch.Tensor, topk_ids: torch.Tensor, p: RoutingParams) -> torch.Tensor:
    """The top-k weights of given ids (also used by routing replay): [T, K] fp32."""
    return ref.weights_for_ids(scores, topk_ids, p.norm_topk_prob, p.routed_scaling_factor)


def group_masked_choice(
    scores: torch.Tensor, bias: torch.Tensor | None, p: RoutingParams, mask_value: MaskValue = "-inf"
) -> torch.Tensor:
    """choice scores [T, E] with experts outside the selected groups masked."""
    return ref.group_masked_choice(scores, bias, p.topk_method, p.n_group, p.topk_group, mask_value)


def grouped_topk_ref(
    logits: torch.Tensor, bias: torch.Tensor | None, p: RoutingParams, mask_value: MaskValue = "-inf"
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] fp32 -> (topk_weights [T, K] fp32, topk_ids [T, K] int32)."""
    return ref.grouped_topk_ref(
        logits, bias, p.top_k, p.scoring_func, p.topk_method, p.n_group, p.topk_group,  # type: ignore[arg-type]
        p.norm_topk_prob, p.routed_scaling_factor, mask_value,
    )
