"""Grouped top-k routing math (pure torch), DeepSeek's reference semantics.

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
from typing import Literal

import torch

MaskValue = Literal["-inf", "zero"]


@dataclass(frozen=True)
class RoutingParams:
    top_k: int
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def gate_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """logits: [T, E] fp32 -> scores [T, E] fp32."""
    if scoring_func == "softmax":
        return logits.softmax(dim=-1, dtype=torch.float32)
    return logits.float().sigmoid()


def weights_for_ids(scores: torch.Tensor, topk_ids: torch.Tensor, p: RoutingParams) -> torch.Tensor:
    """The top-k weights of given ids (also used by routing replay): [T, K] fp32."""
    weights = scores.gather(1, topk_ids.long())
    if p.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * p.routed_scaling_factor


def group_masked_choice(
    scores: torch.Tensor, bias: torch.Tensor | None, p: RoutingParams, mask_value: MaskValue = "-inf"
) -> torch.Tensor:
    """choice scores [T, E] with experts outside the selected groups masked."""
    choice = scores if bias is None else scores + bias
    if p.topk_method == "greedy" or p.n_group == 1:
        return choice
    t, e = choice.shape
    grouped = choice.view(t, p.n_group, e // p.n_group)
    if p.topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.max(dim=-1).values  # [T, G]
    group_idx = group_scores.topk(p.topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    keep = keep.unsqueeze(-1).expand(t, p.n_group, e // p.n_group).reshape(t, e)
    fill = float("-inf") if mask_value == "-inf" else 0.0
    return choice.masked_fill(~keep, fill)


def grouped_topk_ref(
    logits: torch.Tensor, bias: torch.Tensor | None, p: RoutingParams, mask_value: MaskValue = "-inf"
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] fp32 -> (topk_weights [T, K] fp32, topk_ids [T, K] int32)."""
    scores = gate_scores(logits, p.scoring_func)
    choice = group_masked_choice(scores, bias, p, mask_value)
    topk_ids = choice.topk(p.top_k, dim=-1, sorted=True).indices  # [T, K]
    return weights_for_ids(scores, topk_ids, p), topk_ids.to(torch.int32)
