"""The only places the model communicates: LayerCommunicator (inside each decoder layer) and
VocabCommunicator (the model's embed and logits boundary).

Each layer runs prepare_attn -> attention -> prepare_mlp -> mlp -> postprocess_layer (SGLang's
DeepseekV2DecoderLayer workflow). In one process the communicator only does the fused residual-add +
RMSNorm. Under tensor parallelism (dp_size = ep_size = 1 so far):
- prepare_mlp all-reduces o_proj's partial sums over the attention-TP group (heads are split) before the
  residual add;
- postprocess_layer all-reduces the MLP's partial sums over the TP group (dense MLP and shared experts split
  their intermediate), then adds the replicated part: the routed experts run whole on every rank, on the
  full hidden state, so their output is already complete and is added once, after the reduction.
DP attention (gather the full batch before the MoE, slice it back after) and expert parallelism plug in
here too, reading the ParallelInfo, without touching the model math.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .forward_batch import ForwardBatch
from .layers.norm import RMSNorm
from .parallel import ParallelInfo


def _all_reduce(x: torch.Tensor, group: object, size: int) -> torch.Tensor:
    """Sum of x over group (in place); identity on a group of one (no torch.distributed needed)."""
    if size > 1:
        dist.all_reduce(x, group=group)  # type: ignore[arg-type]
    return x


# (x, group, size) -> the sum of x over group. Chosen at construction: _all_reduce (None), or exact mode's
# layers/exact.py exact_all_reduce (all_gather + a rank-order fp32 tree).
AllReduce = Callable[[torch.Tensor, object, int], torch.Tensor]


class LayerCommunicator:
    def __init__(
        self,
        parallel: ParallelInfo,
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
        all_reduce: AllReduce | None = None,
    ) -> None:
        if parallel.dp_size > 1 or parallel.ep_size > 1:
            raise NotImplementedError(
                f"parallel={parallel}: DP-attention/EP communicators land with the parallel-paths issue"
            )
        self.parallel = parallel
        self._all_reduce = all_reduce or _all_reduce
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def prepare_attn(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [T, D] -> (normed input to attention, residual)."""
        if residual is None:
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm.add_forward(hidden, residual)

    def prepare_mlp(
        self, hidden: torch.Tensor, residual: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: o_proj's output [T, D], partial over the attention-TP ranks' heads."""
        p = self.parallel
        hidden = self._all_reduce(hidden, p.attn_tp_group, p.attn_tp_size)
        return self.post_attention_layernorm.add_forward(hidden, residual)

    def postprocess_layer(
        self,
        partial: torch.Tensor | None,
        residual: torch.Tensor,
        fb: ForwardBatch,
        replicated: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """partial: the MLP output [T, D] summed over the TP ranks here (dense MLP, split shared experts);
        replicated: a [T, D] complete on every rank, added after the reduction (the routed experts, with the
        fused shared experts if any). At least one of the two is given."""
        p = self.parallel
        if partial is None:
            assert replicated is not None
            return replicated, residual
        hidden = self._all_reduce(partial, p.tp_group, p.tp_size)
        if replicated is not None:
            hidden = replicated + hidden
        return hidden, residual


class VocabCommunicator:
    """The embed and logits boundary: the vocab-parallel embedding's partial lookups are summed, the
    vocab-sharded logits gathered. Identity in one process."""

    def __init__(self, parallel: ParallelInfo, all_reduce: AllReduce | None = None) -> None:
        self.group, self.size = parallel.tp_group, parallel.tp_size
        self._all_reduce = all_reduce or _all_reduce

    def reduce_embedding(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, D], zeros in rows whose token lives on another rank -> the full lookup."""
        return self._all_reduce(hidden, self.group, self.size)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [N, V / R], this rank's vocab slice -> [N, V] (rank order is vocab order)."""
        if self.size == 1:
            return logits
        pieces = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(pieces, logits.contiguous(), group=self.group)
        return torch.cat(pieces, dim=-1)
