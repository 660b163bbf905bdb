"""MoE layer: router -> routed experts (grouped compute) + shared experts.

Shape legend: T tokens, D hidden, E routed experts, I moe_intermediate_size, K top-k, S shared experts.
w13: [E, 2I, D] (gate_proj rows then up_proj rows, nn.Linear layout); w2: [E, D, I].
An id of -1 in topk_ids means "not on this rank" (expert parallelism) and contributes nothing.

Shared experts fused (EngineConfig.shared_experts): the shared MLP of intermediate S*I is S experts of I
(silu(gate) * up is elementwise over the intermediate, and the down sums over it), so after loading they
are copied into w13/w2 rows E..E+S-1 and every token gets them as S more pairs of weight 1: [T, K + S],
appended by the router (router.py: by the top-k kernel itself, or two cats); the capturer records the [T, K].

Tensor parallelism (tp_size R > 1): the routed experts stay replicated (expert parallelism will shard them):
every rank runs the router and all routed experts on the full hidden state, so their output is complete and
needs no reduction. The unfused shared experts split their intermediate (mlp.py) and return a partial sum.
forward_parts keeps the two apart, so LayerCommunicator.postprocess_layer reduces only the partial one;
fused shared experts are replicated with the routed ones.

Expert parallelism: the TokenDispatcher (dispatcher.py), chosen at construction, moves the routed pairs to the
ranks that hold their experts and back; w13/w2 then hold only this rank's E/ep rows (dispatcher.experts;
expert_slice cuts them from full weights). Shared experts run here on this rank's own tokens (replicated).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from r3trace.capture.recorder import RouteRecorder

from ..config import ModelConfig
from ..forward_batch import ForwardBatch
from .dispatcher import NullDispatcher, TokenDispatcher
from .exact import exact_linear, exact_silu
from .mlp import MLP
from .router import Router, RoutingOps

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grouped_experts_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Reference grouped computation: sort (token, k) pairs by expert, one GEMM pair per expert.

    x: [T, D]; topk_ids/topk_weights: [T, K] -> [T, D] in x's dtype (accumulated in fp32).
    """
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()  # [T*K]
    order = torch.argsort(flat_ids, stable=True)  # -1 ids sort first and are skipped
    token_of = order // k  # [T*K] token row of each sorted pair
    flat_w = topk_weights.reshape(-1)[order]
    n_skipped = int((flat_ids < 0).sum())
    counts = torch.bincount(flat_ids[flat_ids >= 0], minlength=w13.shape[0]).tolist()  # one host sync
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    start = n_skipped
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])  # [n, D]
        out.index_add_(0, rows, y.float() * flat_w[start : start + n, None])
        start += n
    return out.to(x.dtype)


def exact_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Exact mode's experts: each (token, k) pair through exact_linear (w13, then w2), then per token the
    sequential fp32 sum over k = 0..K-1 of w_k * y_k. A pair's bits depend on its token and expert only.

    x: [T, D]; topk_ids/topk_weights: [T, K] -> [T, D] in x's dtype. Ids of -1 add exact zeros."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()  # [T*K]
    y = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)  # [T*K, D]
    for expert in flat[flat >= 0].unique().tolist():  # one host sync
        pairs = (flat == expert).nonzero()[:, 0]  # [n] flat pair indices
        gate, up = exact_linear(x[pairs // k], w13[expert]).chunk(2, dim=-1)  # [n, I] each
        y[pairs] = exact_linear(exact_silu(gate) * up, w2[expert]).float()  # [n, D]
    y = y.view(t, k, -1)  # [T, K, D]
    w = topk_weights.float()
    out = w[:, 0, None] * y[:, 0]
    for j in range(1, k):
        out = out + w[:, j, None] * y[:, j]
    return out.to(x.dtype)


def make_experts_fn(backend: str) -> ExpertsFn:
    if backend == "exact":
        return exact_experts
    if backend == "ref":
        return grouped_experts_ref
    from r3trace.kernels.fused_moe import fused_moe

    return fused_moe  # type: ignore[no-any-return]


class MoE(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        recorder: RouteRecorder,
        routing: RoutingOps,
        experts_fn: ExpertsFn,
        dtype: torch.dtype,
        device: torch.device | str,
        fuse_shared: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        dispatcher: TokenDispatcher | None = None,
    ) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.dispatcher = dispatcher or NullDispatcher(e)
        local = len(self.dispatcher.experts)
        if fuse_shared and local != e:
            # fused shared pairs would be dispatched like routed ones; under EP every rank computes them itself
            raise ValueError(f"fuse_shared_experts with expert parallelism ({local} of {e} experts on this rank)")
        self.num_routed = local
        self.num_fused = cfg.n_shared_experts if fuse_shared else 0  # S rows after the E routed ones
        self.gate = Router(cfg, layer_id, recorder, routing, device, self.num_fused)
        rows = local + self.num_fused
        self.w13 = nn.Parameter(torch.empty(rows, 2 * i, d, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(rows, d, i, dtype=dtype, device=device), requires_grad=False)
        self.shared_experts = (
            MLP(d, i * cfg.n_shared_experts, dtype, device, *((0, 1) if fuse_shared else (tp_rank, tp_size)))
            if cfg.n_shared_experts > 0
            else None
        )
        self.experts_fn = experts_fn

    def post_load(self) -> None:
        """Fused shared experts: copy the loaded shared MLP into w13/w2 rows E.. and drop the MLP."""
        if not self.num_fused or self.shared_experts is None:
            return
        i, e = self.w2.shape[2], self.num_routed
        mlp = self.shared_experts
        for s in range(self.num_fused):
            cols = slice(s * i, (s + 1) * i)
            self.w13.data[e + s, :i].copy_(mlp.gate_proj.weight.data[cols])
            self.w13.data[e + s, i:].copy_(mlp.up_proj.weight.data[cols])
            self.w2.data[e + s].copy_(mlp.down_proj.weight.data[:, cols])
        self.shared_experts = None

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x: [T, D] -> [T, D] (one process: the sum of forward_parts)."""
        routed, shared = self.forward_parts(x, fb)
        return routed if shared is None else routed + shared

    def forward_parts(self, x: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [T, D] -> (routed [T, D] complete on every rank, unfused shared experts [T, D] partial over the
        TP ranks, or None)."""
        topk_weights, topk_ids = self.gate(x, fb)  # [T, K + S]: the routes (captured inside) + the fused shared
        d = self.dispatcher.dispatch(x, topk_ids, topk_weights)  # [R, D], [R, K + S] local ids
        expert_out = self.experts_fn(d.hidden, self.w13, self.w2, d.topk_ids, d.topk_weights)  # [R, D]
        out = self.dispatcher.combine(expert_out, d.handle)  # [T, D]
        return out, (self.shared_experts(x) if self.shared_experts is not None else None)
