"""The routing op: the single place where routes exist in the engine.

Every MoE layer's gate runs here, so route capture (the injected RouteRecorder) and routing replay
(forced ids from ForwardBatch.replay) hook in exactly one spot. The top-k implementation is chosen at
construction (`ref` torch or `triton` fused), never inside forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from r3trace.capture.recorder import RouteRecorder

from ..config import ModelConfig
from ..forward_batch import ForwardBatch
from .routing import RoutingParams, gate_scores, grouped_topk_ref, weights_for_ids

# (logits [T, E], correction bias [E] | None, params, ids_out [T, K] int32 | None) -> (weights, ids);
# a backend may write the ids into ids_out (the capture buffer) and return it, or ignore it.
TopkFn = Callable[
    [torch.Tensor, "torch.Tensor | None", RoutingParams, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor]"
]


def make_topk_fn(backend: str) -> TopkFn:
    if backend == "ref":
        def ref_topk(
            logits: torch.Tensor, bias: torch.Tensor | None, p: RoutingParams, ids_out: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return grouped_topk_ref(logits, bias, p)  # new tensors; capture copies them

        return ref_topk
    from r3trace.kernels.topk import grouped_topk

    def triton_topk(
        logits: torch.Tensor, bias: torch.Tensor | None, p: RoutingParams, ids_out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_topk(
            logits, bias, p.top_k, p.scoring_func, p.topk_method, p.n_group, p.topk_group,
            p.norm_topk_prob, p.routed_scaling_factor, ids_out=ids_out,
        )

    return triton_topk


class Router(nn.Module):
    """Gate of one MoE layer. weight: [E, D] fp32 (kept in fp32 like transformers and DeepSeek)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        recorder: RouteRecorder,
        topk_fn: TopkFn,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.recorder = recorder
        self.topk_fn = topk_fn
        self.params = RoutingParams(
            top_k=cfg.num_experts_per_tok,
            scoring_func=cfg.scoring_func,
            topk_method=cfg.topk_method,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
        e, d = cfg.n_routed_experts, cfg.hidden_size
        self.weight = nn.Parameter(torch.empty(e, d, dtype=torch.float32, device=device), requires_grad=False)
        self.e_score_correction_bias: torch.Tensor | None
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> router logits [T, E] fp32."""
        return F.linear(x.float(), self.weight)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (topk_weights [T, K] fp32, topk_ids [T, K] int32)."""
        logits = self.logits(x)
        ids_out = self.recorder.route_buffer(self.layer_id, x.shape[0])
        topk_weights, topk_ids = self.topk_fn(logits, self.e_score_correction_bias, self.params, ids_out)
        if fb.replay is not None:
            topk_weights, topk_ids = self._apply_replay(logits, topk_weights, topk_ids, fb)
        self.recorder.capture(self.layer_id, topk_ids, topk_weights)
        return topk_weights, topk_ids

    def _apply_replay(
        self, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Forced ids take the gate's own weights for those ids (Megatron's RouterReplay does the same),
        # so the replayed forward differs from the recorded one only where routes differ.
        assert fb.replay is not None
        forced = fb.replay.topk_ids[:, self.layer_id].to(ids.dtype)  # [T, K]
        mask = fb.replay.row_mask.unsqueeze(-1)  # [T, 1]
        new_ids = torch.where(mask, forced, ids)
        forced_weights = weights_for_ids(gate_scores(logits, self.params.scoring_func), new_ids, self.params)
        return torch.where(mask, forced_weights, weights), new_ids
