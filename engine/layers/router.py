"""The routing op: the single place where routes exist in the engine.

Every MoE layer's gate runs here, so route capture (the injected RouteRecorder) and routing replay
(forced ids from ForwardBatch.replay) hook in exactly one spot. The rows are the routed batch's (recorder.py):
this rank's tokens, or under DP attention every DP rank's gathered (the replay plan gathered with them), or
under EP with attention TP > 1 this rank's scattered slice, whose ids a RouteGather brings back before capture.
The top-k implementation is chosen at construction (`ref` torch or `triton` fused), never inside forward.

RoutingParams holds one layer's gate settings; the functions beside it unpack them for the grouped top-k reference
written once in kernels/topk.py (`grouped_topk_ref` and its parts: DeepSeek's gate in plain torch, checked against
transformers' gates by tests/kernels/test_topk.py). The ref backend, routing replay's weights and replay-check's
near-tie margins call them, so they run the same lines as the reference the Triton kernel is tested against.

Shape legend: T tokens, D hidden, E routed experts, K top-k, S fused shared experts, G groups.

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

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from r3trace.capture.recorder import RouteRecorder
from r3trace.kernels import topk as ref
from r3trace.kernels.router_logits import router_logits_ref
from r3trace.kernels.topk import (
    MaskValue,
    gate_scores,
    sum_partials,  # the top-k kernel's order of adding partial logits
)

from ..forward_batch import ForwardBatch
from ..model_config import ModelConfig
from .exact import exact_linear, exact_sigmoid, exact_softmax


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


class SharedTail(NamedTuple):
    """The fused shared experts' pairs every token gets: ids [1, S] int32 (E..E+S-1), weights [1, S] fp32 (1.0)."""

    ids: torch.Tensor
    weights: torch.Tensor


class Routes(NamedTuple):
    weights: torch.Tensor  # [T, K + S] fp32: the routed pairs, then the shared tail's (S = 0 without one)
    ids: torch.Tensor  # [T, K + S] int32: what the MoE computes over
    routed_ids: torch.Tensor  # [T, K] int32: what the capturer records (its own buffer when the kernel wrote it)


# (logits [T, E], correction bias [E] | None, params, ids_out [T, K] int32 | None, shared tail | None) -> Routes;
# a backend may write the routed ids into ids_out (the capture buffer) and return it as routed_ids, or ignore it.
TopkFn = Callable[
    [torch.Tensor, "torch.Tensor | None", RoutingParams, "torch.Tensor | None", "SharedTail | None"], Routes
]


def append_shared(weights: torch.Tensor, ids: torch.Tensor, shared: SharedTail | None) -> Routes:
    """[T, K] routes -> [T, K + S] with the shared tail: two torch.cat kernels (the fused top-k's twin)."""
    if shared is None:
        return Routes(weights, ids, ids)
    t = ids.shape[0]
    all_ids = torch.cat([ids, shared.ids.expand(t, -1)], dim=1)  # [T, K + S]
    return Routes(torch.cat([weights, shared.weights.expand(t, -1)], dim=1), all_ids, ids)


# (x [T, D], gate weight [E, D] fp32) -> router logits [T, E] fp32, or [P, T, E] partial sums the top-k adds
LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# (topk_ids [n, K] int32, topk_weights [n, K] fp32) of this rank's scattered rows -> the same [A * n, K] of its
# DP rank's rows, all-gathered over attention-TP (communicator.RouteCommunicator): what capture records under EP.
RouteGather = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# (logits [T, E] fp32, scoring_func) -> gate scores [T, E] fp32: what routing replay weighs forced ids with
ScoresFn = Callable[[torch.Tensor, str], torch.Tensor]


class RoutingOps(NamedTuple):
    logits: LogitsFn
    topk: TopkFn
    scores: ScoresFn = gate_scores


def logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return router_logits_ref(x, weight)  # the router-logits kernel's own reference (kernels/router_logits.py)


def logits_exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Exact mode's router logits [T, E] fp32: exact_linear's fixed tree, batch-invariant."""
    return exact_linear(x.float(), weight)


def exact_gate_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """gate_scores with position-free ops (exact.py: torch's CPU sigmoid is not). [T, E] -> [T, E] fp32."""
    return exact_softmax(logits) if scoring_func == "softmax" else exact_sigmoid(logits)


def make_routing_ops(backend: str) -> RoutingOps:
    """The gate's two ops for a top-k backend. ref: the cast + fp32 GEMM, the reference top-k and append_shared's
    two cats. triton: router_logits reads x without a cast kernel, and the top-k kernel stores the [T, K + S]
    routes itself. invariant (EngineConfig.batch_invariant): triton with router_logits' kernel at every T (no torch
    fallback above 256 rows). exact: exact logits and exact_topk."""
    if backend == "exact":
        return RoutingOps(logits_exact, exact_topk, exact_gate_scores)
    if backend == "ref":
        return RoutingOps(logits_ref, _make_topk_fn(backend))
    from r3trace.kernels.router_logits import router_logits

    if backend == "invariant":
        return RoutingOps(partial(router_logits, torch_above=None), _make_topk_fn("triton"))
    return RoutingOps(router_logits, _make_topk_fn(backend))


def exact_topk(
    logits: torch.Tensor, bias: torch.Tensor | None, p: RoutingParams, ids_out: torch.Tensor | None,
    shared: SharedTail | None,
) -> Routes:
    """grouped_topk_ref's steps with position-free gate scores (exact.py: torch's CPU sigmoid is not); the group
    mask, top-k and weights are the reference's own (max, top-k and a K-sum per row: row-independent)."""
    scores = exact_gate_scores(logits, p.scoring_func)  # [T, E]
    choice = group_masked_choice(scores, bias, p)  # [T, E]
    ids = choice.topk(p.top_k, dim=-1, sorted=True).indices  # [T, K]
    return append_shared(weights_for_ids(scores, ids, p), ids.to(torch.int32), shared)


def _make_topk_fn(backend: str) -> TopkFn:
    if backend == "ref":
        def ref_topk(
            logits: torch.Tensor, bias: torch.Tensor | None, p: RoutingParams, ids_out: torch.Tensor | None,
            shared: SharedTail | None,
        ) -> Routes:
            return append_shared(*grouped_topk_ref(logits, bias, p), shared)  # new tensors; capture copies them

        return ref_topk
    from r3trace.kernels.topk import grouped_topk

    def triton_topk(
        logits: torch.Tensor, bias: torch.Tensor | None, p: RoutingParams, ids_out: torch.Tensor | None,
        shared: SharedTail | None,
    ) -> Routes:
        n_shared = shared.ids.shape[1] if shared is not None else 0
        weights, ids = grouped_topk(
            logits, bias, p.top_k, p.scoring_func, p.topk_method, p.n_group, p.topk_group,
            p.norm_topk_prob, p.routed_scaling_factor, ids_out=ids_out, n_shared=n_shared,
        )
        if n_shared:
            return Routes(weights, ids, ids_out if ids_out is not None else ids[:, : p.top_k])
        return append_shared(weights, ids, shared)

    return triton_topk


class Router(nn.Module):
    """Gate of one MoE layer. weight: [E, D] fp32 (kept in fp32 like transformers and DeepSeek)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        recorder: RouteRecorder,
        ops: RoutingOps,
        device: torch.device | str,
        n_shared: int = 0,
        route_gather: RouteGather | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.route_gather = route_gather
        self.recorder = recorder
        self._logits_fn, self.topk_fn, self._scores_fn = ops
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
        # n_shared = S fused shared experts (moe.py): ids E..E+S-1 of weight 1.0 appended to every token's routes
        self.n_shared = n_shared
        self.shared_ids: torch.Tensor
        self.shared_weights: torch.Tensor
        self.register_buffer(
            "shared_ids", torch.arange(e, e + n_shared, dtype=torch.int32, device=device)[None], persistent=False
        )
        self.register_buffer("shared_weights", torch.ones(1, n_shared, device=device), persistent=False)

    @property
    def shared(self) -> SharedTail | None:
        return SharedTail(self.shared_ids, self.shared_weights) if self.n_shared else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> router logits [T, E] fp32 (partial sums added in the top-k kernel's order)."""
        return sum_partials(self._logits_fn(x, self.weight))

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (topk_weights [T, K + S] fp32, topk_ids [T, K + S] int32); S = 0 without fused shared
        experts. The capturer records the [T, K] routed part."""
        logits = self._logits_fn(x, self.weight)  # [T, E], or [P, T, E] partial sums the top-k adds
        # x's rows are the routed batch's, except under a route gather (the rows are a slice of it)
        row0 = fb.route_row0
        ids_out = self.recorder.route_buffer(self.layer_id, x.shape[0], row0) if self.route_gather is None else None
        weights, ids, routed_ids = self.topk_fn(logits, self.e_score_correction_bias, self.params, ids_out, self.shared)
        k = self.params.top_k
        if fb.replay is not None:  # the plan is on x's rows (communicator.RouteCommunicator.moe_batch)
            routed_weights, routed_ids = self._apply_replay(sum_partials(logits), weights[:, :k], routed_ids, fb)
            weights, ids, _ = append_shared(routed_weights, routed_ids, self.shared)
        if self.route_gather is None:
            self.recorder.capture(self.layer_id, routed_ids, weights[:, :k], row0=row0)
        else:
            self.recorder.capture(self.layer_id, *self.route_gather(routed_ids, weights[:, :k]), row0=row0)
        return weights, ids

    def _apply_replay(
        self, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Forced ids take the gate's own weights for those ids (Megatron's RouterReplay does the same),
        # so the replayed forward differs from the recorded one only where routes differ.
        assert fb.replay is not None
        forced = fb.replay.topk_ids[:, self.layer_id].to(ids.dtype)  # [T, K]
        mask = fb.replay.row_mask.unsqueeze(-1)  # [T, 1]
        new_ids = torch.where(mask, forced, ids)
        forced_weights = weights_for_ids(self._scores_fn(logits, self.params.scoring_func), new_ids, self.params)
        return torch.where(mask, forced_weights, weights), new_ids
