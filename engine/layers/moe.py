"""MoE layer: router -> routed experts (grouped compute) + shared experts.

Shape legend: T tokens, D hidden, E routed experts, I moe_intermediate_size, K top-k, S shared experts.
w13: [E, 2I, D] (gate_proj rows then up_proj rows, nn.Linear layout); w2: [E, D, I].
An id of -1 in topk_ids means "not on this rank" (expert parallelism) and contributes nothing.

Shared experts fused (EngineConfig.shared_experts): the shared MLP of intermediate S*I is S experts of I
(silu(gate) * up is elementwise over the intermediate, and the down sums over it), so after loading they
are copied into w13/w2 rows E..E+S-1 and every token gets them as S more pairs of weight 1: [T, K + S],
appended by the router (router.py: by the top-k kernel itself, or two cats); the capturer records the [T, K].

Tensor parallelism (tp_size R > 1): the routed experts stay replicated (expert parallelism shards them, below):
every rank runs the router and all routed experts on the full hidden state, so their output is complete and
needs no reduction. The unfused shared experts split their intermediate (mlp.py) and return a partial sum.
forward_parts keeps the two apart, so LayerCommunicator.postprocess_layer reduces only the partial one;
fused shared experts are replicated with the routed ones.

Expert parallelism: the TokenDispatcher (dispatcher.py), chosen at construction, moves the routed pairs to the
ranks that hold their experts and back; w13/w2 then hold only this rank's E/ep rows (dispatcher.experts;
expert_slice cuts them from full weights). Shared experts run here on this rank's own tokens (replicated).

Redundant experts: with an ExpertMap (expert_map.py; set by apply_expert_location in expert_placement.py) the
router's logical ids, which capture records, become physical slots between the router and the dispatcher, and
w13/w2 hold this rank's P/G slots (physical_expert_weights). update_expert_placement swaps in a new placement
between two forwards: weights first, then the map.

route_gather (communicator.RouteCommunicator): under EP with attention TP > 1 the router sees this rank's
scattered slice, and the ids are all-gathered over attention-TP before capture.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from r3trace.capture.recorder import NullRecorder, RouteRecorder
from r3trace.kernels.moe.reference import fused_moe_ref

from ..forward_batch import ForwardBatch
from ..model_config import ModelConfig
from .dispatcher import NullDispatcher, TokenDispatcher
from .exact import exact_linear, exact_pair_linear, exact_silu
from .expert_location import ExpertLocation, ExpertLocationError, held_experts
from .expert_map import ExpertMap
from .matmul import MatmulImpl
from .mlp import MLP
from .router import RouteGather, Router, RoutingOps

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
    return _sum_over_k(y.view(t, k, -1), topk_weights, x.dtype)


def exact_experts_gathered(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """exact_experts without a host sync, for an engine that captures CUDA graphs in exact mode: every pair at once,
    its expert's weights gathered beside it (exact_pair_linear: exact_linear's products and tree, row by row), so the
    bits are exact_experts' (tests/engine/test_exact_mode.py). The gather doubles the memory traffic of the products:
    2.0x exact_experts' time at the sample model's MoE (256 tokens, K = 4, fp32, CPU), hence not the default.

    x: [T, D]; topk_ids/topk_weights: [T, K] -> [T, D] in x's dtype. Ids of -1 add exact zeros."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()  # [T*K]
    expert = flat.clamp(min=0)  # an id of -1 (not on this rank) computes expert 0's product, masked to +0 below
    pairs = x.index_select(0, torch.arange(t * k, device=x.device) // k)  # [T*K, D] each pair's token
    gate, up = exact_pair_linear(pairs, w13, expert).chunk(2, dim=-1)  # [T*K, I] each
    y = exact_pair_linear(exact_silu(gate) * up, w2, expert).float()  # [T*K, D]
    return _sum_over_k(y.masked_fill((flat < 0)[:, None], 0.0).view(t, k, -1), topk_weights, x.dtype)


def _sum_over_k(y: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [T, K, D] fp32 -> sum_k w_k * y_k [T, D], sequential over k = 0..K-1 (exact mode's fixed order)."""
    w = topk_weights.float()
    out = w[:, 0, None] * y[:, 0]
    for j in range(1, y.shape[1]):
        out = out + w[:, j, None] * y[:, j]
    return out.to(dtype)


def make_experts_fn(backend: str, cfg: ModelConfig | None = None, dtype: torch.dtype = torch.float32,
                    graphs: bool = False) -> ExpertsFn:
    """The routed experts' function, picked once. triton: the fused MoE's plan for cfg's D and I in dtype (gemv or
    grouped by T, kernels/moe/registry.py); invariant: its batch-invariant plan (grouped, one tile set for every T);
    graphs: the engine captures CUDA graphs (exact mode then takes its sync-free experts)."""
    if backend == "exact":
        return exact_experts_gathered if graphs else exact_experts
    if backend == "ref":
        return fused_moe_ref  # the kernels' own reference (kernels/moe/reference.py)
    if cfg is None:
        raise ValueError(f"make_experts_fn({backend!r}) needs the model config (the fused MoE plan is built for D, I)")
    from r3trace.kernels.moe.registry import MoeShape, resolve_moe

    return resolve_moe(MoeShape(cfg.hidden_size, cfg.moe_intermediate_size), dtype, invariant=backend == "invariant")


class MoE(nn.Module):
    # The logical -> physical step (None: slots are the logical experts, as without a placement). A class default
    # so the constructor stays the dispatcher's; expert_placement.apply_expert_location sets it once built.
    expert_map: ExpertMap | None = None
    # Sees the physical ids [T, K] of every forward (capture's optional second column); NullRecorder: off.
    physical_recorder: RouteRecorder = NullRecorder()

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
        route_gather: RouteGather | None = None,
        matmul: MatmulImpl = "torch",
    ) -> None:
        """matmul: the unfused shared experts' linears (matmul.py)."""
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.dispatcher = dispatcher or NullDispatcher(e)
        local = len(self.dispatcher.experts)
        if fuse_shared and not isinstance(self.dispatcher, NullDispatcher):
            # fused shared pairs would be dispatched like routed ones; under EP every rank computes them itself
            raise ValueError(f"fuse_shared_experts with expert parallelism ({local} of {e} experts on this rank)")
        self.num_routed = local
        self.num_fused = cfg.n_shared_experts if fuse_shared else 0  # S rows after the E routed ones
        self.gate = Router(cfg, layer_id, recorder, routing, device, self.num_fused, route_gather)
        rows = local + self.num_fused
        self.w13 = nn.Parameter(torch.empty(rows, 2 * i, d, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(rows, d, i, dtype=dtype, device=device), requires_grad=False)
        self.shared_experts = (
            MLP(d, i * cfg.n_shared_experts, dtype, device, *((0, 1) if fuse_shared else (tp_rank, tp_size)), matmul)
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
        topk_ids = self.physical_ids(topk_ids, fb.route_row0)  # [T, K + S] physical slots; capture saw the logical ids
        d = self.dispatcher.dispatch(x, topk_ids, topk_weights)  # [R, D], [R, K + S] local ids
        expert_out = self.experts_fn(d.hidden, self.w13, self.w2, d.topk_ids, d.topk_weights)  # [R, D]
        out = self.dispatcher.combine(expert_out, d.handle)  # [T, D]
        return out, (self.shared_experts(x) if self.shared_experts is not None else None)

    def physical_ids(self, topk_ids: torch.Tensor, row0: int = 0) -> torch.Tensor:
        """[T, K + S] logical ids -> physical slots; the fused shared columns (E + s) move past the slots (P + s).
        row0: the forward's first row in the recorder's buffer (ForwardBatch.route_row0)."""
        m = self.expert_map
        k = topk_ids.shape[1] - self.num_fused
        if m is None:  # no placement: slot e is expert e, and the step costs nothing
            self.physical_recorder.capture(self.gate.layer_id, topk_ids[:, :k], row0=row0)
            return topk_ids
        phys = m.to_physical(topk_ids[:, :k])  # [T, K]
        self.physical_recorder.capture(self.gate.layer_id, phys, row0=row0)
        if self.num_fused:
            phys = torch.cat([phys, topk_ids[:, k:] + (m.num_physical - m.num_logical)], dim=1)
        return phys

    @torch.no_grad()
    def update_expert_placement(
        self, new_location: ExpertLocation, full_w13: torch.Tensor, full_w2: torch.Tensor
    ) -> int:
        """Between two forwards, on every EP rank at the same forward boundary: copy the weights of this rank's
        slots whose expert changed (full_w13 [E, 2I, D], full_w2 [E, D, I]: this layer's logical weights), then
        switch the map. Returns the slots copied.

        Both the weight copies and the map's (ExpertMap.load_) are in place and queued on the current stream in
        that order, so a later forward, eager or a CUDA graph captured earlier, sees the new weights with the new
        map; nothing runs between them. Routes are logical: requests in flight keep theirs, only the slot that
        computes a pair changes. Every check comes before the first copy: a refused placement changes nothing."""
        m = self.expert_map
        if m is None:
            raise ExpertLocationError(
                f"layer {self.gate.layer_id} has no expert map: apply_expert_location when the model is built"
            )
        loc, lid = new_location, self.gate.layer_id
        if (loc.num_logical, loc.num_physical, loc.ep_size) != (m.num_logical, m.num_physical, m.location.ep_size):
            raise ExpertLocationError(
                f"new placement has E={loc.num_logical}, P={loc.num_physical}, ep_size={loc.ep_size}; layer {lid} "
                f"was built for E={m.num_logical}, P={m.num_physical}, ep_size={m.location.ep_size}"
            )
        want13, want2 = (m.num_logical, *self.w13.shape[1:]), (m.num_logical, *self.w2.shape[1:])
        if tuple(full_w13.shape) != want13 or tuple(full_w2.shape) != want2:
            raise ExpertLocationError(
                f"full_w13 {tuple(full_w13.shape)}, full_w2 {tuple(full_w2.shape)}: layer {lid} needs {want13}, {want2}"
            )
        new_held = torch.tensor(held_experts(loc, lid, m.ep_rank))  # [P/G]
        old_held = torch.tensor(held_experts(m.location, lid, m.ep_rank))
        moved = (new_held != old_held).nonzero()[:, 0]  # [n] local rows to rewrite
        if moved.numel():
            experts = new_held[moved].to(full_w13.device)  # the logical expert each rewritten slot now holds
            idx = moved.to(self.w13.device)
            self.w13.data.index_copy_(0, idx, full_w13.index_select(0, experts).to(self.w13.device, self.w13.dtype))
            self.w2.data.index_copy_(0, idx, full_w2.index_select(0, experts).to(self.w2.device, self.w2.dtype))
        m.load_(loc)  # after the copy: the switch
        return int(moved.numel())
