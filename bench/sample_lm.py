"""The sample model for training: the engine's own modules with grad on, plus DeepSeek-V3's MTP module.

Shape legend: B sequences, T tokens a sequence, N = B*T packed rows, D hidden, E routed experts, K top-k,
V vocab, L num_hidden_layers (the MTP layer is layer L, as DeepSeek stores it).

What is the engine's and what is the harness's:
- every weight and every op of the decoder stack is r3trace.engine's: DeepseekModel (embed_tokens,
  DecoderLayer = MLAAttention + MoE/MLP + RMSNorm through LayerCommunicator), Router + grouped_topk_ref,
  grouped_experts_ref, RotaryEmbedding, on the MLA `normal` path of a prefix-free ForwardBatch of B requests.
- one substitution: each MLAAttention's backend is PackedCausalAttention, one batched causal SDPA over
  [B, H, T, *] instead of RefAttention's per-request loop (same softmax(q k^T * scale) v, fp32 here).
- the MTP module (MTPLayer) wires engine modules the way DeepSeek-V3 / SGLang's deepseek_nextn do:
  h' = eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]), one DecoderLayer, shared_head.norm, the shared lm_head.
- routes come through the injected recorder (StepRoutes); gate scores for the sequence-wise balance loss
  through a forward hook on each Router that recomputes sigmoid(Router.logits(x)) (engine files unchanged).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.layers.mlp import linear
from r3trace.engine.layers.norm import RMSNorm
from r3trace.engine.layers.router import Router
from r3trace.engine.model import DecoderLayer, DeepseekModel
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.parallel import ParallelInfo


class StepRoutes:
    """RouteRecorder keeping this step's topk_ids per layer (no history: a training run has thousands)."""

    def __init__(self) -> None:
        self.topk_ids: dict[int, torch.Tensor] = {}

    def on_forward_begin(self, batch: object) -> None:
        self.topk_ids = {}

    def route_buffer(self, layer_id: int, num_tokens: int, row0: int = 0) -> torch.Tensor | None:
        return None  # no buffer of its own: the router allocates the ids and capture() keeps them

    def capture(
        self, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None, row0: int = 0
    ) -> None:
        self.topk_ids[layer_id] = topk_ids.detach()  # [N, K]

    def on_forward_end(self, batch: object) -> None:
        return None


class PackedCausalAttention:
    """AttentionBackend for B equal-length prefix-free requests: one SDPA call instead of B."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def mha(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
        k_starts: list[int], k_lens: list[int], scale: float,
    ) -> torch.Tensor:
        """q, k: [N, H, Dqk]; v: [N, H, Dv] -> [N, H, Dv]."""
        t = self.seq_len
        if any(n != t for n in k_lens) or fb.has_prefix:
            raise ValueError(f"PackedCausalAttention: needs prefix-free requests of {t} tokens, got {k_lens}")
        n, h = q.shape[0], q.shape[1]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(n // t, t, h, x.shape[-1]).transpose(1, 2)  # [B, H, T, *]

        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True, scale=scale)
        return out.transpose(1, 2).reshape(n, h, v.shape[-1])

    def absorbed(self, q: torch.Tensor, kv_cache: torch.Tensor, fb: ForwardBatch, kv_lora_rank: int,
                 scale: float) -> torch.Tensor:
        raise NotImplementedError("training runs the MLA normal path only")


class MTPLayer(nn.Module):
    """DeepSeek-V3's multi-token-prediction module; its parameters save as model.layers.{L}.*."""

    def __init__(
        self, cfg: ModelConfig, ecfg: EngineConfig, recorder: StepRoutes, model: DeepseekModel
    ) -> None:
        super().__init__()
        d, dt, dev = cfg.hidden_size, ecfg.torch_dtype, ecfg.device
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, dt, dev)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, dt, dev)
        self.eh_proj = linear(2 * d, d, dt, dev)  # [D, 2D]
        self.layer = DecoderLayer(cfg, ecfg, cfg.num_hidden_layers, ParallelInfo(), recorder, model.rotary)
        self.shared_head_norm = RMSNorm(d, cfg.rms_norm_eps, dt, dev)

    def forward(
        self, h: torch.Tensor, emb_next: torch.Tensor, fb: ForwardBatch, kv: torch.Tensor
    ) -> torch.Tensor:
        """h: main model's final (normed) hidden [N, D]; emb_next: emb(t_{i+1}) [N, D] -> [N, D] normed."""
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], dim=-1))
        hidden, residual = self.layer(x, None, fb, kv)
        return self.shared_head_norm(hidden + residual)


class SampleLM(nn.Module):
    def __init__(self, cfg: ModelConfig, seq_len: int, device: str) -> None:
        super().__init__()
        self.cfg = cfg
        self.seq_len = seq_len
        ecfg = EngineConfig(dtype="float32", device=device, mla_path="normal", max_context_len=seq_len)
        self.recorder = StepRoutes()
        self.model = DeepseekModel(cfg, ecfg, ParallelInfo(), self.recorder)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, ecfg.torch_dtype, device)
        self.mtp = MTPLayer(cfg, ecfg, self.recorder, self.model)
        self.routers = {m.layer_id: m for m in self.modules() if isinstance(m, Router)}
        self.scores: dict[int, torch.Tensor] = {}
        for router in self.routers.values():
            router.register_forward_hook(self._keep_scores)
        backend = PackedCausalAttention(seq_len)
        for layer in [*self.model.layers, self.mtp.layer]:
            layer.self_attn.backend = backend
        self.requires_grad_(True)
        self.device = device
        self._batches: dict[int, ForwardBatch] = {}

    def packed_batch(self, batch: int) -> ForwardBatch:
        """B prefix-free requests of T tokens, request b in rows b*T .. b*T+T-1 (built once per B)."""
        if batch not in self._batches:
            n = batch * self.seq_len
            r2t = torch.arange(n, dtype=torch.int32, device=self.device).view(batch, self.seq_len)
            self._batches[batch] = ForwardBatch.build(
                forward_id=0, input_ids=[0] * n, prefix_lens=[0] * batch, extend_lens=[self.seq_len] * batch,
                req_pool_indices=list(range(batch)), out_cache_loc=r2t.flatten(), req_to_token=r2t,
                logits_rows=[], device=self.device,
            )
        return self._batches[batch]

    def _keep_scores(self, router: nn.Module, inputs: tuple[Any, ...], _out: object) -> None:
        assert isinstance(router, Router)
        self.scores[router.layer_id] = router.logits(inputs[0]).sigmoid()  # [N, E], with grad

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """N(0, 0.02); output projections scaled by 1/sqrt(2 * depth) (GPT-2); norms 1; biases 0."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        depth = self.cfg.num_hidden_layers + 1
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            is_out = name.endswith(("o_proj.weight", "down_proj.weight", ".w2"))
            std = 0.02 / math.sqrt(2 * depth) if is_out else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for router in self.routers.values():
            assert router.e_score_correction_bias is not None
            router.e_score_correction_bias.zero_()

    def forward(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """windows: [B, T+2] token ids -> (main loss, MTP loss), mean cross-entropy each."""
        b, t = windows.shape[0], self.seq_len
        fb = self.packed_batch(b)
        fb.input_ids = windows[:, :t].reshape(-1)
        self.recorder.on_forward_begin(fb)
        # A fresh scratch cache a step: writing into one kept buffer would chain every step's graph.
        kv = torch.empty(self.cfg.num_hidden_layers + 1, b * t, self.cfg.kv_cache_dim, device=windows.device)
        h = self.model(fb, kv)  # [N, D]
        loss = F.cross_entropy(self.lm_head(h).float(), windows[:, 1 : t + 1].reshape(-1))
        emb_next = self.model.embed_tokens(windows[:, 1 : t + 1].reshape(-1))
        h2 = self.mtp(h, emb_next, fb, kv[-1])
        mtp_loss = F.cross_entropy(self.lm_head(h2).float(), windows[:, 2 : t + 2].reshape(-1))
        return loss, mtp_loss

    def balance_loss(self, batch: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, summed over MoE layers (alpha applied by the caller).

        Per sequence: f_i = E / (K T) * #tokens routed to i, P_i = mean_t s_it / sum_j s_jt;
        loss = sum_i f_i P_i (1.0 when balanced).
        """
        e, k = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        total = torch.zeros((), device=self.device)
        for layer_id, scores in self.scores.items():
            ids = self.recorder.topk_ids[layer_id].long().view(batch, -1, k)  # [B, T, K]
            t = ids.shape[1]
            counts = torch.zeros(batch, e, device=ids.device).scatter_add_(
                1, ids.view(batch, -1), torch.ones(batch, t * k, device=ids.device))
            f = counts * e / (k * t)  # [B, E]
            s = scores.view(batch, t, e)
            p = (s / s.sum(-1, keepdim=True)).mean(1)  # [B, E]
            total = total + (f * p).sum(-1).mean()
        return total

    @torch.no_grad()
    def update_bias(self, gamma: float) -> torch.Tensor:
        """Auxiliary-loss-free balancing: bias_i += gamma * sign(mean load - load_i) from this step's routes.

        Returns this step's max/mean expert load per MoE layer (MTP last): [L_moe + 1], on device."""
        e = self.cfg.n_routed_experts
        skew = []
        for layer_id, ids in sorted(self.recorder.topk_ids.items()):
            load = torch.bincount(ids.reshape(-1).long(), minlength=e).float()  # [E]
            bias = self.routers[layer_id].e_score_correction_bias
            assert bias is not None
            bias += gamma * torch.sign(load.mean() - load)
            skew.append(load.max() / load.mean())
        return torch.stack(skew)


def hf_state_dict(lm: SampleLM) -> dict[str, torch.Tensor]:
    """Engine names -> DeepSeek-V3 Hugging Face names, bf16 (correction biases fp32, as DeepSeek ships)."""
    cfg, out = lm.cfg, {}
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    mtp_names = {"mtp.enorm.": "enorm.", "mtp.hnorm.": "hnorm.", "mtp.eh_proj.": "eh_proj.",
                 "mtp.shared_head_norm.": "shared_head.norm.", "mtp.layer.": ""}
    tensors = {**dict(lm.named_parameters()), **{k: v for k, v in lm.named_buffers()
                                                 if k.endswith("e_score_correction_bias")}}
    for name, t in tensors.items():
        for old, new in mtp_names.items():
            if name.startswith(old):
                name = mtp_prefix + new + name[len(old):]
        t = t.detach().cpu()
        if name.endswith(".w13"):
            i = cfg.moe_intermediate_size
            base = name[: -len("w13")] + "experts."
            for x in range(t.shape[0]):
                out[f"{base}{x}.gate_proj.weight"] = t[x, :i]
                out[f"{base}{x}.up_proj.weight"] = t[x, i:]
        elif name.endswith(".w2"):
            base = name[: -len("w2")] + "experts."
            for x in range(t.shape[0]):
                out[f"{base}{x}.down_proj.weight"] = t[x]
        else:
            out[name] = t
    # DeepSeek-V3 stores the MTP layer's shared embedding and head as copies under its own prefix.
    out[mtp_prefix + "embed_tokens.weight"] = out["model.embed_tokens.weight"]
    out[mtp_prefix + "shared_head.head.weight"] = out["lm_head.weight"]
    return {k: (v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)).contiguous()
            for k, v in out.items()}


def hf_config(cfg_fields: dict[str, Any]) -> dict[str, Any]:
    """config.json for transformers' DeepseekV3ForCausalLM and ModelConfig.from_hf."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "dtype": "bfloat16",
        "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu", "rope_interleave": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg_fields.pop("rope_theta")},
        "num_key_value_heads": cfg_fields["num_attention_heads"], "tie_word_embeddings": False,
        "use_cache": True, "initializer_range": 0.02, "pad_token_id": None, **cfg_fields,
    }


def save_checkpoint(lm: SampleLM, config_json: dict[str, Any], out: Path) -> int:
    """Write config.json + model.safetensors; returns the safetensors size in bytes."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    path = out / "model.safetensors"
    save_file(hf_state_dict(lm), str(path), metadata={"format": "pt"})
    return path.stat().st_size
