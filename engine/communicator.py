"""The only places the model communicates: LayerCommunicator (inside each decoder layer), VocabCommunicator
(the model's embed and logits boundary) and RouteCommunicator (the router's rows: replay plan in, captured
ids out).

Each layer runs prepare_attn -> attention -> prepare_mlp -> mlp -> postprocess_layer (SGLang's
DeepseekV2DecoderLayer workflow). Where a tensor's rows live is SGLang's ScatterMode
(python/sglang/srt/layers/communicator.py at 0090b34c), with TP = 4, DP = 2 and sequences a, b, c, d:

| mode         | ranks 0..3 hold      | who is here                                                          |
| ------------ | -------------------- | -------------------------------------------------------------------- |
| SCATTERED    | a, b, c, d           | the MoE input under expert parallelism (each attention-TP rank a 1/A) |
| TP_ATTN_FULL | ab, ab, cd, cd       | the layer input and output, the attention input                      |
| FULL         | abcd, abcd, abcd ... | the MLP input under DP attention (dense, and MoE with ep_size 1)     |

The MLP's input mode is chosen once per layer at construction (mlp_input_mode); A = attention-TP size:
- TP_ATTN_FULL (no DP attention, no EP: plain tensor parallelism): prepare_mlp all-reduces o_proj's partial
  sums over attention-TP; postprocess_layer all-reduces the MLP's partial sums over TP (dense MLP and shared
  experts split their intermediate) and adds the replicated part (the routed experts run whole on every rank,
  their output complete, added once after the reduction);
- FULL: prepare_mlp reduces o_proj over attention-TP, adds the residual, norms, then gathers the DP ranks'
  rows as DpLayout says ("max": an all-gather of [max, D] padded rows over the dp group; "sum": each rank
  writes its rows at its offset in zeros and the dp group all-reduces). The dp group holds one rank of each
  DP rank (the same attention-TP rank), so every member contributes; SGLang all-reduces over the whole TP
  group instead and lets only attention-TP rank 0 write. postprocess_layer all-reduces the partial sums over
  TP and takes this DP rank's rows back; the residual never left this rank;
- SCATTERED: prepare_mlp reduce-scatters o_proj's partial sums over attention-TP (rows padded to a multiple
  of A) and scatters the residual the same way; the MoE dispatches each rank's slice to the expert ranks and
  runs its shared experts whole on it; postprocess_layer all-gathers hidden and residual over attention-TP.
Every reduction goes through one function, `all_reduce`, given at construction (exact mode passes a
fixed-order sum): the reduce-scatter is that all-reduce and a slice, and the "sum" gather its all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .distributed import all_gather_into
from .dp_layout import DpLayout
from .forward_batch import ForwardBatch, ReplayPlan
from .layers.norm import RMSNorm
from .parallel import ParallelInfo

# (x, group, group size) -> the sum of x over the group, on every rank (may reuse x's storage)
AllReduce = Callable[[torch.Tensor, Any, int], torch.Tensor]


def all_reduce_sum(x: torch.Tensor, group: object, size: int) -> torch.Tensor:
    """Sum of x over group (in place); identity on a group of one (no torch.distributed needed)."""
    if size > 1:
        dist.all_reduce(x, group=group)  # type: ignore[arg-type]
    return x


def all_gather_rows(x: torch.Tensor, group: object, size: int) -> torch.Tensor:
    """x: [n, ...] on each of size ranks -> [size * n, ...] in group rank order."""
    if size == 1:
        return x
    out = x.new_empty(size * x.shape[0], *x.shape[1:])
    all_gather_into(out, x.contiguous(), group)
    return out


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class ScatterMode(Enum):
    SCATTERED = "scattered"
    TP_ATTN_FULL = "tp_attn_full"
    FULL = "full"


def mlp_input_mode(parallel: ParallelInfo, is_moe: bool) -> ScatterMode:
    """The MLP's input for a layer (SGLang's LayerScatterModes: a sparse layer under an all-to-all backend is
    SCATTERED, any MLP under DP attention FULL)."""
    if is_moe and parallel.ep_size > 1:
        return ScatterMode.SCATTERED
    if parallel.dp_size > 1:
        return ScatterMode.FULL
    return ScatterMode.TP_ATTN_FULL


def _layout(fb: ForwardBatch) -> DpLayout:
    if fb.dp_layout is None:
        raise RuntimeError("DP attention: ForwardBatch.dp_layout is None; set it from gather_dp_layout first")
    return fb.dp_layout


def dp_gather(x: torch.Tensor, layout: DpLayout, parallel: ParallelInfo, all_reduce: AllReduce) -> torch.Tensor:
    """This DP rank's rows x [n, W] -> the gathered batch [layout.buffer_len, W] (dp group, layout's mode)."""
    p = parallel
    if layout.mode == "max":
        return all_gather_rows(_pad_rows(x, layout.max_len), p.dp_group, p.dp_size)
    out = x.new_zeros(layout.buffer_len, *x.shape[1:])
    out[layout.local_start : layout.local_start + x.shape[0]] = x
    return all_reduce(out, p.dp_group, p.dp_size)


class LayerCommunicator:
    def __init__(
        self,
        parallel: ParallelInfo,
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
        mlp_mode: ScatterMode = ScatterMode.TP_ATTN_FULL,
        all_reduce: AllReduce = all_reduce_sum,
    ) -> None:
        self.parallel = parallel
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp_mode = mlp_mode
        self.all_reduce = all_reduce

    def prepare_attn(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [T, D] -> (normed input to attention, residual), TP_ATTN_FULL in and out."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm.add_forward(hidden, residual)

    def prepare_mlp(
        self, hidden: torch.Tensor, residual: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: o_proj's output [T, D], partial over the attention-TP ranks' heads; residual [T, D] ->
        (MLP input in mlp_mode, residual: [T, D], or this rank's scattered slice under SCATTERED)."""
        p = self.parallel
        if self.mlp_mode is ScatterMode.SCATTERED:
            a = p.attn_tp_size
            rows = _round_up(hidden.shape[0], a) // a
            mine = slice(p.attn_tp_rank * rows, (p.attn_tp_rank + 1) * rows)
            hidden = self.all_reduce(_pad_rows(hidden, rows * a), p.attn_tp_group, a)[mine]
            return self.post_attention_layernorm.add_forward(hidden, _pad_rows(residual, rows * a)[mine])
        hidden = self.all_reduce(hidden, p.attn_tp_group, p.attn_tp_size)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        if self.mlp_mode is ScatterMode.FULL:  # norm before the gather: per row, and on T rows instead of P * max
            hidden = dp_gather(hidden, _layout(fb), p, self.all_reduce)
        return hidden, residual

    def postprocess_layer(
        self,
        partial: torch.Tensor | None,
        residual: torch.Tensor,
        fb: ForwardBatch,
        replicated: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """partial: the MLP output summed over the TP ranks here (dense MLP, split shared experts; complete
        under SCATTERED, where the shared experts are whole); replicated: complete on every rank, added after
        the reduction (the routed experts, with the fused shared experts if any). Rows in mlp_mode; at least
        one of the two is given. -> (hidden, residual) [T, D], TP_ATTN_FULL."""
        p = self.parallel
        if self.mlp_mode is ScatterMode.SCATTERED:
            hidden = partial if replicated is None else replicated if partial is None else replicated + partial
            assert hidden is not None
            t, a = fb.num_tokens, p.attn_tp_size  # the padding rows of prepare_mlp dropped
            return all_gather_rows(hidden, p.attn_tp_group, a)[:t], all_gather_rows(residual, p.attn_tp_group, a)[:t]
        if self.mlp_mode is ScatterMode.FULL:
            layout = _layout(fb)
            own = slice(layout.local_start, layout.local_start + layout.local_count)
            if partial is None:
                assert replicated is not None
                return replicated[own], residual
            hidden = self.all_reduce(partial, p.tp_group, p.tp_size)[own]
            return (hidden if replicated is None else replicated[own] + hidden), residual
        if partial is None:  # TP_ATTN_FULL: the one-process path is this one, unchanged
            assert replicated is not None
            return replicated, residual
        hidden = self.all_reduce(partial, p.tp_group, p.tp_size)
        if replicated is not None:
            hidden = replicated + hidden
        return hidden, residual


class VocabCommunicator:
    """The embed and logits boundary: the vocab-parallel embedding's partial lookups are summed, the
    vocab-sharded logits gathered, over the attention-TP group (the whole TP group without DP attention; under
    DP attention each DP rank embeds and samples its own tokens, as in SGLang). Identity on a group of one."""

    def __init__(self, parallel: ParallelInfo, all_reduce: AllReduce = all_reduce_sum) -> None:
        self.group, self.size = parallel.attn_tp_group, parallel.attn_tp_size
        self.all_reduce = all_reduce

    def reduce_embedding(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, D], zeros in rows whose token lives on another rank -> the full lookup."""
        return self.all_reduce(hidden, self.group, self.size)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [N, V / R], this rank's vocab slice -> [N, V] (rank order is vocab order)."""
        if self.size == 1:
            return logits
        pieces = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(pieces, logits.contiguous(), group=self.group)
        return torch.cat(pieces, dim=-1)


class RouteCommunicator:
    """The router's rows, for the MoE layers' input mode (one for the whole model: every MoE layer has it).

    - moe_batch(fb): the batch the routers see, its ReplayPlan moved to their rows: gathered with the hidden
      states under FULL (every rank computes every gathered row's routes and must force the same ids), this
      attention-TP rank's slice under SCATTERED; one collective a forward, and only when some DP rank replays.
    - gather_routes(ids, weights): under SCATTERED with A > 1, the scattered slices' top-k ids (and weights, as
      their bits) all-gathered over attention-TP, so capture sees this DP rank's rows in order: one collective
      per MoE layer into a buffer preallocated for max_tokens rows. None where there is nothing to gather, or
      nobody keeps the routes (gather=False: capture off).
    """

    def __init__(self, parallel: ParallelInfo, mode: ScatterMode, num_layers: int, top_k: int, max_tokens: int,
                 device: torch.device | str, gather: bool = True) -> None:  # fmt: skip
        self.parallel, self.mode = parallel, mode
        self.plan_shape = (num_layers, top_k)  # a ReplayPlan row: [L, K]
        a = parallel.attn_tp_size
        self.gathered: torch.Tensor | None = None
        if gather and mode is ScatterMode.SCATTERED and a > 1:  # [rows, 2K] int32: ids, then the fp32 weights' bits
            self.gathered = torch.empty(_round_up(max_tokens, a), 2 * top_k, dtype=torch.int32, device=device)

    @property
    def gather_routes(self) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        return self._gather_routes if self.gathered is not None else None

    def _gather_routes(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [n, K] int32, weights [n, K] fp32 of this rank's slice -> [A * n, K] each (views of the buffer)."""
        assert self.gathered is not None
        p, k = self.parallel, ids.shape[1]
        rows = p.attn_tp_size * ids.shape[0]
        if rows > self.gathered.shape[0]:
            raise RuntimeError(f"route gather: {rows} rows exceed the buffer of {self.gathered.shape[0]}")
        out = self.gathered[:rows]
        local = torch.cat([ids, weights.float().view(torch.int32)], dim=1)  # [n, 2K]
        all_gather_into(out, local, p.attn_tp_group)
        return out[:, :k], out[:, k:].view(torch.float32)

    def moe_batch(self, fb: ForwardBatch) -> ForwardBatch:
        """fb, or a copy whose replay plan is on the routers' rows (see the class docstring)."""
        p = self.parallel
        if self.mode is ScatterMode.FULL:
            layout = _layout(fb)
            if not layout.any_replay:
                return fb
            return _with_replay(fb, self._gather_plan(fb, layout))
        if fb.replay is None or self.mode is ScatterMode.TP_ATTN_FULL or p.attn_tp_size == 1:
            return fb
        a, plan = p.attn_tp_size, fb.replay
        rows = _round_up(fb.num_tokens, a) // a
        mine = slice(p.attn_tp_rank * rows, (p.attn_tp_rank + 1) * rows)
        return _with_replay(fb, ReplayPlan(_pad_rows(plan.topk_ids, rows * a)[mine],
                                           _pad_rows(plan.row_mask, rows * a)[mine]))  # fmt: skip

    def _gather_plan(self, fb: ForwardBatch, layout: DpLayout) -> ReplayPlan:
        """Every DP rank's plan rows, gathered (padding rows and ranks without a plan: not forced). Gathered,
        never summed: the ids are integers and the rows do not overlap. [T, 1 + L * K] int32 a rank."""
        t, p = fb.num_tokens, self.parallel
        l, k = self.plan_shape
        if fb.replay is None:
            packed = torch.zeros(t, 1 + l * k, dtype=torch.int32, device=fb.input_ids.device)
        else:
            mask, ids = fb.replay.row_mask, fb.replay.topk_ids
            packed = torch.cat([mask.to(torch.int32)[:, None], ids.reshape(t, l * k).to(torch.int32)], dim=1)
        every = all_gather_rows(_pad_rows(packed, layout.max_len), p.dp_group, p.dp_size)  # [P * max, W]
        out = every.new_zeros(layout.buffer_len, every.shape[1])
        for d, n in enumerate(layout.counts):
            out[layout.start_of(d) : layout.start_of(d) + n] = every[d * layout.max_len : d * layout.max_len + n]
        return ReplayPlan(out[:, 1:].reshape(-1, l, k), out[:, 0].bool())


def _with_replay(fb: ForwardBatch, plan: ReplayPlan) -> ForwardBatch:
    """A shallow copy (same tensors) with another plan: once a forward, and only when routes are forced."""
    return replace(fb, replay=plan)
