"""NextN: DeepSeek-V3's multi-token-prediction (MTP) module as the draft model of speculative decoding.

Shape legend: T tokens, D hidden, V vocab, S KV slots, C latent cache row, E routed experts.

Position t of the draft reads the target's final (normed) hidden state h_t and the token after it, x_{t+1}:
    h' = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])  ->  one decoder layer (MLA + MoE)  ->  shared_head.norm
and the target's lm_head on h' proposes x_{t+2}. A chain of d drafts reuses the one layer, its own output h' standing
in for the target's h at the next position (SGLang's deepseek_nextn + EAGLE chain). The embedding and the head are
the target's: the checkpoint's copies under the MTP prefix (DeepSeek ships them equal) are not loaded, as SGLang
skips them. The layer keeps its own latent cache [S, C], indexed by the target's KV slots.

Fail-closed capture opt-out: the layer's router is built with a NullRecorder of its own, and check_draft_capture
(run when the draft is built) raises if any routing op of the draft could write a recorder's buffer, so a draft
forward never touches the target's routes (SGLang's disable_routed_experts_capture_for_draft, checked instead of
trusted). The draft's layer id is num_hidden_layers, which no target capture buffer has a row for.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from r3trace.capture.recorder import NullRecorder

from ..engine_config import EngineConfig, EngineConfigError
from ..forward_batch import ForwardBatch
from ..layers.linear import replicated_linear
from ..layers.moe import MoE
from ..layers.norm import RMSNorm
from ..layers.router import Router
from ..model import DecoderLayer, DeepseekForCausalLM
from ..parallel import ParallelInfo
from ..weights import WeightsError

_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# The MTP module's own weights (the rest of its prefix is the decoder layer's); the embedding and head are shared.
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "shared_head.norm.weight": "shared_head_norm.weight"}
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


class DraftCaptureError(RuntimeError):
    """A draft routing op could write a route recorder's buffer; the message names the module."""


class NextNDraft(nn.Module):
    def __init__(self, target: DeepseekForCausalLM, ecfg: EngineConfig) -> None:
        super().__init__()
        cfg = target.config
        ecfg = ecfg.draft_config  # row-invariant mode's draft: the fast kernels (EngineConfig.draft_config)
        d, dtype, device = cfg.hidden_size, ecfg.torch_dtype, ecfg.device
        self.layer_id = cfg.num_hidden_layers  # where DeepSeek stores it: model.layers.{L}
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, ecfg.norm_impl)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, ecfg.norm_impl)
        self.eh_proj = replicated_linear(2 * d, d, dtype, device, ecfg.matmul_impl)  # [D, 2D]
        self.layer = DecoderLayer(cfg, ecfg, self.layer_id, ParallelInfo(), NullRecorder(), target.model.rotary)
        self.shared_head_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, ecfg.norm_impl)

    def forward(
        self, fb: ForwardBatch, embedded: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """embedded: [T, D] embed(x_{t+1}); hidden: [T, D] h_t; kv_cache: [S, C] the draft layer's -> h' [T, D]."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        out, residual = self.layer(x, None, fb, kv_cache)
        return self.shared_head_norm.add_forward(out, residual)[0]

    def load(self, mtp_weights: dict[str, torch.Tensor]) -> None:
        """Fill every parameter from the checkpoint's model.layers.{L}.* tensors (DeepseekForCausalLM.mtp_weights);
        every problem is collected into one WeightsError."""
        prefix = f"model.layers.{self.layer_id}."
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        params.update({k: v for k, v in self.named_buffers() if k.endswith("e_score_correction_bias")})
        moe = self.layer.mlp
        inter = moe.w2.shape[2] if isinstance(moe, MoE) else 0
        filled: set[str] = set()
        experts: set[tuple[int, str]] = set()
        problems: list[str] = []
        for name, tensor in mtp_weights.items():
            if not name.startswith(prefix):
                continue  # a second MTP layer (num_nextn_predict_layers > 1): only the first drafts
            rest = name[len(prefix):]
            if rest in _SHARED:
                continue
            expert = _EXPERT.match(rest)
            if expert and isinstance(moe, MoE) and int(expert.group(1)) < moe.num_routed:
                e, part = int(expert.group(1)), expert.group(2)
                dest = moe.w2.data[e] if part == "down_proj" else moe.w13.data[e, : inter] if part == "gate_proj" \
                    else moe.w13.data[e, inter:]
                if tuple(dest.shape) != tuple(tensor.shape):
                    problems.append(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
                    continue
                dest.copy_(tensor.to(dest.dtype))
                experts.add((e, part))
                continue
            target = params.get(_OWN.get(rest, "layer." + rest))
            if target is None:
                problems.append(f"unexpected: {name}")
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                problems.append(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
                continue
            target.data.copy_(tensor.to(target.dtype))
            filled.add(_OWN.get(rest, "layer." + rest))
        if isinstance(moe, MoE):
            missing_experts = moe.num_routed * 3 - len(experts)
            if missing_experts:
                problems.append(f"{prefix}mlp.experts: missing {missing_experts} tensors")
            filled.update({"layer.mlp.w13", "layer.mlp.w2"})
        problems += [f"missing: {prefix}{n}" for n in sorted(set(params) - filled)]
        if problems:
            raise WeightsError("\n".join(["the checkpoint's MTP layer does not fit the NextN draft:", *problems]))
        self.layer.self_attn.post_load()
        if isinstance(moe, MoE):
            moe.post_load()


def build_draft(target: DeepseekForCausalLM, ecfg: EngineConfig) -> NextNDraft:
    """The NextN draft of a loaded target, its capture opt-out checked; a one-line error without an MTP layer."""
    cfg = target.config
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    if not any(n.startswith(prefix) for n in target.mtp_weights):
        raise EngineConfigError(
            f"speculative_algorithm={ecfg.speculative_algorithm!r}: the checkpoint has no MTP layer ({prefix}* tensors;"
            f" num_nextn_predict_layers={cfg.num_nextn_predict_layers})"
        )
    draft = NextNDraft(target, ecfg)
    draft.load(target.mtp_weights)
    draft.eval()
    check_draft_capture(draft, target)
    return draft


def check_draft_capture(draft: nn.Module, target: nn.Module) -> None:
    """Raise DraftCaptureError unless no routing op of the draft can write a recorder's buffer: every Router records
    into a NullRecorder (exactly that class: a subclass could keep rows) that is not the target's recorder, gathers no
    routes through a communicator buffer, and is not a module of the target; every MoE's physical recorder is a
    NullRecorder too."""
    target_modules = {id(m) for m in target.modules()}
    target_recorder = getattr(target, "recorder", None)
    for name, m in draft.named_modules():
        where = f"draft module {name or '<root>'}"
        if id(m) in target_modules and isinstance(m, (Router, MoE)):
            raise DraftCaptureError(f"{where} is a routing module of the target: its routes would be the target's")
        if isinstance(m, Router):
            if type(m.recorder) is not NullRecorder or m.recorder is target_recorder:
                raise DraftCaptureError(f"{where} records into {type(m.recorder).__name__}: a draft router must be "
                                        "built with a NullRecorder of its own")
            if m.route_gather is not None:
                raise DraftCaptureError(f"{where} gathers its routes into a communicator buffer")
        if isinstance(m, MoE) and type(m.physical_recorder) is not NullRecorder:
            raise DraftCaptureError(f"{where} records physical ids into {type(m.physical_recorder).__name__}")
