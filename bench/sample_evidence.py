"""Evidence that the sample model routes like a real MoE, measured through the engine on held-out text.

Shape legend: W windows, T tokens a window, N tokens, E routed experts, K top-k, L_moe MoE layers.

Pure functions over expert ids first; `engine_routes` runs the saved checkpoint in r3trace.engine
(build_model + load_weights, ref backends, MLA normal path) and returns per-token losses and routes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from r3trace.capture.recorder import ListRecorder
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.model import build_model
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.weights import load_weights


def expert_load(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids: [..., K] expert ids -> load [E] fp64 (token-expert assignments per expert)."""
    return torch.bincount(ids.reshape(-1).long(), minlength=num_experts).double()


def heat(load: torch.Tensor) -> tuple[float, float]:
    """load: [E] -> (max/mean, entropy / ln E): 1.0 and 1.0 for a perfectly even load."""
    p = load / load.sum()
    entropy = -(p[p > 0] * p[p > 0].log()).sum().item()
    return (load.max() / load.mean()).item(), entropy / math.log(load.numel())


def jsd(p: torch.Tensor, q: torch.Tensor) -> float:
    """Jensen-Shannon divergence in bits (0 equal .. 1 disjoint) of two [E] loads or distributions."""
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a: torch.Tensor) -> float:
        nz = a > 0
        return (a[nz] * (a[nz] / m[nz]).log2()).sum().item()

    return (kl(p) + kl(q)) / 2


def prev_overlap(ids: torch.Tensor, num_experts: int) -> float:
    """ids: [W, T, K] -> mean over t >= 1 of |S_t & S_{t-1}| / K within each window."""
    k = ids.shape[-1]
    onehot = torch.zeros(*ids.shape[:2], num_experts, dtype=torch.bool)
    onehot.scatter_(2, ids.long(), True)  # [W, T, E]
    return ((onehot[:, 1:] & onehot[:, :-1]).sum(-1).double() / k).mean().item()


def shuffled_overlap(ids: torch.Tensor, num_experts: int, gen: torch.Generator) -> float:
    """The chance level of prev_overlap for this layer's own expert popularity: tokens permuted at random."""
    flat = ids.reshape(-1, ids.shape[-1])
    perm = torch.randperm(flat.shape[0], generator=gen)
    return prev_overlap(flat[perm].view(ids.shape), num_experts)


def routing_evidence(
    routes: dict[str, torch.Tensor], moe_layer_ids: list[int], num_experts: int, seed: int
) -> dict[str, Any]:
    """routes: {domain: [W, T, L_moe, K]} -> per-layer heat, domain specialisation and temporal locality.

    jsd_between: mean over domain pairs of JSD(load of d1, load of d2);
    jsd_within:  mean over domains of JSD between the loads of two random halves of its windows.
    """
    gen = torch.Generator().manual_seed(seed)
    domains = sorted(routes)
    k = next(iter(routes.values())).shape[-1]
    out: dict[str, Any] = {}
    for j, layer_id in enumerate(moe_layer_ids):
        per_domain = {d: routes[d][:, :, j] for d in domains}  # [W, T, K]
        loads = {d: expert_load(ids, num_experts) for d, ids in per_domain.items()}
        skew, entropy = heat(sum(loads.values()))  # type: ignore[arg-type]
        pairs = [(a, b) for i, a in enumerate(domains) for b in domains[i + 1 :]]
        within = []
        for ids in per_domain.values():
            perm = torch.randperm(ids.shape[0], generator=gen)
            half = ids.shape[0] // 2
            a, b = ids[perm[:half]], ids[perm[half:]]
            within.append(jsd(expert_load(a, num_experts), expert_load(b, num_experts)))
        out[str(layer_id)] = {
            "max_over_mean": round(skew, 3),
            "entropy_norm": round(entropy, 4),
            "jsd_between_domains": round(sum(jsd(loads[a], loads[b]) for a, b in pairs) / len(pairs), 4),
            "jsd_within_domain_halves": round(sum(within) / len(within), 4),
            "overlap_prev": round(
                sum(prev_overlap(i, num_experts) for i in per_domain.values()) / len(domains), 4),
            "overlap_chance_shuffled": round(
                sum(shuffled_overlap(i, num_experts, gen) for i in per_domain.values()) / len(domains), 4),
            "overlap_chance_uniform": round(k / num_experts, 4),
            "domain_max_over_mean": {d: round(heat(loads[d])[0], 3) for d in domains},
            "domain_top_experts": {
                d: [[int(e), round(float(loads[d][e] / loads[d].sum()), 3)] for e in loads[d].topk(3).indices]
                for d in domains
            },
        }
    return out


def unigram_loss(train_ids: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats) of targets under add-one-smoothed train-split token frequencies."""
    counts = torch.bincount(train_ids.long(), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return -logp[targets.reshape(-1).long()].mean().item()


@torch.no_grad()
def engine_routes(
    model_dir: Path, windows: torch.Tensor, device: str, dtype: str, batch: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """windows: [W, T+1] -> (nll [W, T] fp32 of windows[:, 1:], topk_ids [W, T, L_moe, K] int32), on CPU.

    Runs the checkpoint in the engine: each window is one prefix-free request of T tokens."""
    cfg = ModelConfig.from_hf(model_dir)
    recorder = ListRecorder()
    ecfg = EngineConfig(dtype=dtype, device=device)  # type: ignore[arg-type]
    model = build_model(cfg, ecfg, ParallelInfo(), recorder)
    load_weights(model, model_dir)
    w, t = windows.shape[0], windows.shape[1] - 1
    nll = torch.empty(w, t)
    ids = torch.empty(w, t, len(cfg.moe_layer_ids), cfg.num_experts_per_tok, dtype=torch.int32)
    for s in range(0, w, batch):
        chunk = windows[s : s + batch]
        b = chunk.shape[0]
        r2t = torch.arange(b * t, dtype=torch.int32, device=device).view(b, t)
        fb = ForwardBatch.build(
            forward_id=s, input_ids=chunk[:, :t].reshape(-1).tolist(), prefix_lens=[0] * b,
            extend_lens=[t] * b, req_pool_indices=list(range(b)), out_cache_loc=r2t.flatten(),
            req_to_token=r2t, logits_rows=list(range(b * t)), device=device,
        )
        kv = torch.zeros(cfg.num_hidden_layers, b * t, cfg.kv_cache_dim, dtype=ecfg.torch_dtype,
                         device=device)
        logits = model(fb, kv)  # [b*t, V] fp32
        targets = chunk[:, 1:].reshape(-1).to(device)
        nll[s : s + b] = F.cross_entropy(logits, targets, reduction="none").view(b, t).cpu()
        for j, layer_id in enumerate(cfg.moe_layer_ids):
            ids[s : s + b, :, j] = recorder.routes[layer_id][0].view(b, t, -1).cpu()
        recorder.history.clear()
    return nll, ids
