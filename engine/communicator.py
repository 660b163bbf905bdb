"""LayerCommunicator: the only place a decoder layer may communicate.

Each layer runs prepare_attn -> attention -> prepare_mlp -> mlp -> postprocess_layer (SGLang's
DeepseekV2DecoderLayer workflow). In one process the communicator only does the fused residual-add +
RMSNorm. Tensor parallelism, DP attention (gather the full batch before the MoE, slice it back after)
and expert parallelism plug in here, reading the ParallelInfo, without touching the model math.
"""

from __future__ import annotations

import torch

from .forward_batch import ForwardBatch
from .layers.norm import RMSNorm
from .parallel import ParallelInfo


class LayerCommunicator:
    def __init__(self, parallel: ParallelInfo, input_layernorm: RMSNorm, post_attention_layernorm: RMSNorm) -> None:
        if not parallel.is_single:
            raise NotImplementedError(
                f"parallel={parallel}: TP/DP-attention/EP communicators land with the parallel-paths issue"
            )
        self.parallel = parallel
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
        return self.post_attention_layernorm.add_forward(hidden, residual)

    def postprocess_layer(
        self, hidden: torch.Tensor, residual: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden, residual
