"""DeepSeek-V2/V3 decoder stack over the paged latent cache.

Shape legend: T new tokens, D hidden, V vocab, L layers, S cache slots, C latent cache row.
Parameter names follow the Hugging Face layout (model.layers.N.self_attn.kv_b_proj.weight, ...), except
routed experts, stacked per layer as mlp.w13 [E, 2I, D] and mlp.w2 [E, D, I] (weights.py maps them).

Parallelism (one process per TP rank; ParallelInfo, communicator.py's scatter modes). What each rank holds:

| part               | plain TP (R ranks) | DP attention (A = R / P)       | EP (ep_size G)                       |
| ------------------ | ------------------ | ------------------------------ | ------------------------------------ |
| attention heads    | H / R              | H / A, this DP rank's requests | as without EP                        |
| embedding, lm_head | V / R              | V / A (attention-TP group)     | as without EP                        |
| dense MLP          | I / R, own tokens  | I / R, the DP-gathered batch   | as without EP                        |
| routed experts     | all, own tokens    | all, the DP-gathered batch     | E / G, tokens dispatched to them     |
| shared experts     | I_s / R (or fused) | I_s / R, the DP-gathered batch | whole, on this rank's scattered rows |

The collectives sit in the communicators only: each layer's LayerCommunicator, the VocabCommunicator at the
embed and logits boundary, the RouteCommunicator for the routers' rows, and the MoE's TokenDispatcher.
"""

from __future__ import annotations

import torch
from torch import nn

from r3trace.capture.recorder import NullRecorder, RouteRecorder

from .communicator import LayerCommunicator, RouteCommunicator, VocabCommunicator, all_reduce_sum, mlp_input_mode
from .engine_config import EngineConfig, EngineConfigError
from .expert_placement import apply_expert_location, initial_location
from .forward_batch import ForwardBatch
from .layers.attention_backend import AttentionBackend, DecodeShape, make_attention_backend
from .layers.dispatcher_choice import make_dispatcher
from .layers.exact import exact_all_reduce
from .layers.expert_location import ExpertLocation
from .layers.linear import ColumnParallelLinear, VocabParallelEmbedding
from .layers.mla import MLAAttention
from .layers.mlp import MLP
from .layers.moe import ExpertsFn, MoE, make_experts_fn
from .layers.norm import RMSNorm
from .layers.rope import RotaryEmbedding
from .layers.router import make_routing_ops
from .model_config import ModelConfig
from .parallel import ParallelInfo


def attention_backend(cfg: ModelConfig, ecfg: EngineConfig, parallel: ParallelInfo) -> AttentionBackend:
    """The attention backend for this rank's heads (the triton one resolves its decode kernel here)."""
    shape = DecodeShape(cfg.num_attention_heads // parallel.attn_tp_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    return make_attention_backend(ecfg.attention_impl, ecfg.device, ecfg.decode_kernel, ecfg.page_size, shape,
                                  ecfg.torch_dtype)  # fmt: skip


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ecfg: EngineConfig,
        layer_id: int,
        parallel: ParallelInfo,
        recorder: RouteRecorder,
        rope: RotaryEmbedding,
        routes: RouteCommunicator | None = None,
        num_slots: int | None = None,
        attn_backend: AttentionBackend | None = None,
        experts_fn: ExpertsFn | None = None,
    ) -> None:
        """num_slots: the physical slots P of a placement (None: none, slot e is expert e). attn_backend, experts_fn:
        the model's one attention backend and routed-experts function (None: this layer builds its own)."""
        super().__init__()
        dtype, device = ecfg.torch_dtype, ecfg.device
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ecfg.norm_impl)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ecfg.norm_impl)
        attn_backend = attention_backend(cfg, ecfg, parallel) if attn_backend is None else attn_backend
        self.self_attn = MLAAttention(
            cfg, layer_id, rope, attn_backend, ecfg.mla_impl, dtype, device, ecfg.norm_impl,
            parallel.attn_tp_rank, parallel.attn_tp_size, ecfg.matmul_impl,
        )
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.mlp: nn.Module
        if self.is_moe:
            ep = parallel.ep_size > 1
            slots = cfg.n_routed_experts if num_slots is None else num_slots
            # Under EP the shared experts run whole on this rank's scattered rows (replicated, as under DeepEP).
            shared_rank, shared_size = (0, 1) if ep else (parallel.tp_rank, parallel.tp_size)
            self.mlp = MoE(
                cfg, layer_id, recorder, make_routing_ops(ecfg.topk_impl),
                experts_fn or make_experts_fn(ecfg.moe_impl, cfg, dtype, bool(ecfg.graph_batch_sizes)), dtype, device,
                fuse_shared_experts(ecfg, parallel), shared_rank, shared_size,
                dispatcher=make_dispatcher(slots, parallel.ep_rank, parallel.ep_size, parallel.ep_group,
                                           ecfg.dispatcher_mode, moe_rows_per_rank(ecfg, parallel))
                if ep or num_slots is not None else None,
                route_gather=None if routes is None else routes.gather_routes, matmul=ecfg.matmul_impl,
            )  # fmt: skip
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, device, parallel.tp_rank, parallel.tp_size,
                           ecfg.matmul_impl)
        self.comm = LayerCommunicator(
            parallel, self.input_layernorm, self.post_attention_layernorm, mlp_input_mode(parallel, self.is_moe),
            exact_all_reduce if ecfg.deterministic else all_reduce_sum,
        )

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.comm.prepare_attn(hidden, residual, fb)
        if hidden.shape[0]:  # an idle DP rank (0 tokens) has nothing to attend; it still joins prepare_mlp's gather
            hidden = self.self_attn(hidden, fb, kv_cache)
        hidden, residual = self.comm.prepare_mlp(hidden, residual, fb)
        if isinstance(self.mlp, MoE):
            routed, shared = self.mlp.forward_parts(hidden, fb)
            return self.comm.postprocess_layer(shared, residual, fb, replicated=routed)
        return self.comm.postprocess_layer(self.mlp(hidden), residual, fb)


class DeepseekModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ecfg: EngineConfig, parallel: ParallelInfo, recorder: RouteRecorder,
        num_slots: int | None = None,
    ) -> None:
        super().__init__()
        dtype, device = ecfg.torch_dtype, ecfg.device
        max_pos = ecfg.max_context_len or cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(cfg, max_pos, device, ecfg.rope_backend)
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, parallel.attn_tp_rank, parallel.attn_tp_size, dtype, device
        )
        self.vocab_comm = VocabCommunicator(parallel, exact_all_reduce if ecfg.deterministic else all_reduce_sum)
        moe_mode = mlp_input_mode(parallel, is_moe=True)
        # Routes gathered over attention-TP only for a recorder that keeps them (NullRecorder: capture off).
        self.routes = RouteCommunicator(
            parallel, moe_mode, cfg.num_hidden_layers, cfg.num_experts_per_tok,
            max(ecfg.chunked_prefill_size, ecfg.max_running_requests), device,
            gather=not isinstance(recorder, NullRecorder),
        )
        attn = attention_backend(cfg, ecfg, parallel)  # one for every layer: its decode kernel resolved once
        experts = make_experts_fn(ecfg.moe_impl, cfg, dtype, bool(ecfg.graph_batch_sizes))  # its MoE plan, once
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, ecfg, i, parallel, recorder, self.rotary, self.routes, num_slots, attn, experts)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ecfg.norm_impl)

    def forward(self, fb: ForwardBatch, kv_buffer: torch.Tensor) -> torch.Tensor:
        """-> final hidden states [T, D] (after the last RMSNorm)."""
        hidden = self.vocab_comm.reduce_embedding(self.embed_tokens(fb.input_ids))
        fb = self.routes.moe_batch(fb)  # the replay plan on the routers' rows (fb itself in one process)
        residual: torch.Tensor | None = None
        for layer_id, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, fb, kv_buffer[layer_id])
        assert residual is not None
        return self.norm.add_forward(hidden, residual)[0]


class DeepseekForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ecfg: EngineConfig, parallel: ParallelInfo, recorder: RouteRecorder,
        location: ExpertLocation | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.engine_config = ecfg
        self.recorder = recorder
        self.model = DeepseekModel(cfg, ecfg, parallel, recorder, None if location is None else location.num_physical)
        if location is not None:  # every MoE maps logical ids to slots; the loader fills each rank's slots
            apply_expert_location(self, location, parallel.ep_rank, ecfg.ep_dispatch_algorithm,
                                  ecfg.expert_dispatch_seed)
        self.lm_head = ColumnParallelLinear(
            cfg.hidden_size, cfg.vocab_size, parallel.attn_tp_rank, parallel.attn_tp_size, ecfg.torch_dtype,
            ecfg.device, ecfg.matmul_impl,
        )
        # MTP layers (index >= num_hidden_layers) as loaded: speculative decoding's draft (engine/spec/nextn.py)
        self.mtp_weights: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, kv_buffer: torch.Tensor) -> torch.Tensor:
        """fb: a batch of T new tokens; kv_buffer: [L, S, C] -> logits [N, V] fp32 at fb.logits_indices."""
        self.recorder.on_forward_begin(fb)
        logits = self.compute_logits(fb, kv_buffer)
        self.recorder.on_forward_end(fb)
        return logits

    @torch.no_grad()
    def forward_hidden(self, fb: ForwardBatch, kv_buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, also returning the final hidden states [T, D] of every row (normed: what the lm_head reads, and
        what speculative decoding's MTP draft takes as h_t)."""
        self.recorder.on_forward_begin(fb)
        logits, hidden = self.compute_hidden(fb, kv_buffer)
        self.recorder.on_forward_end(fb)
        return logits, hidden

    @torch.no_grad()
    def compute_hidden(self, fb: ForwardBatch, kv_buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_hidden without the recorder's begin/end hooks (what a speculative verify graph captures)."""
        hidden = self.model(fb, kv_buffer)
        return self.logits(hidden[fb.logits_indices]), hidden

    @torch.no_grad()
    def compute_logits(self, fb: ForwardBatch, kv_buffer: torch.Tensor) -> torch.Tensor:
        """The forward without the recorder's begin/end hooks (what a CUDA graph captures)."""
        hidden = self.model(fb, kv_buffer)
        return self.logits(hidden[fb.logits_indices])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] final hidden states -> logits [N, V] fp32."""
        return self.model.vocab_comm.gather_logits(self.lm_head(hidden)).float()

    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def post_load(self) -> None:
        for layer in self.decoder_layers():
            layer.self_attn.post_load()
            if isinstance(layer.mlp, MoE):
                layer.mlp.post_load()


def fuse_shared_experts(ecfg: EngineConfig, parallel: ParallelInfo) -> bool:
    """EngineConfig.shared_experts resolved for a layout: "auto" is separate under expert parallelism (fused
    shared pairs would be dispatched like routed ones, and every rank computes them on its own rows)."""
    if parallel.ep_size > 1:
        if ecfg.shared_experts == "fused":
            raise EngineConfigError(f"shared_experts='fused' needs ep_size=1 (got {parallel.ep_size}): use 'separate'")
        return False
    return ecfg.fuse_shared_experts


def moe_rows_per_rank(ecfg: EngineConfig, parallel: ParallelInfo) -> int:
    """The most rows one rank's MoE sees in a forward under EP (the low-latency layout's max_tokens): its DP rank's
    batch, scattered over attention TP."""
    per_dp_rank = max(ecfg.chunked_prefill_size, ecfg.max_running_requests)
    return -(-per_dp_rank // parallel.attn_tp_size)


def build_model(
    model_config: ModelConfig, engine_config: EngineConfig, parallel: ParallelInfo, recorder: RouteRecorder
) -> DeepseekForCausalLM:
    """Allocate the model (weights uninitialised: load_weights must fill every tensor). With a placement
    (EngineConfig.has_placement) each MoE holds this rank's P/G physical slots and an ExpertMap."""
    location = initial_location(engine_config, model_config, parallel.ep_size)
    return DeepseekForCausalLM(model_config, engine_config, parallel, recorder, location)
