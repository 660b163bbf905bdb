"""Next-token sampling for one step: greedy, temperature, top-k, top-p, per-request seeds.

B rows (one per request that samples this step), V vocabulary. Sampling is an exponential race,
argmax(probs / q) with q ~ Exp(1), which draws exactly from `probs`. Each seeded request draws its
V exponentials from its own torch.Generator, so its tokens do not depend on the other rows of the
batch; unseeded rows share the engine's generator in one call. Nothing here syncs with the host.
"""

from __future__ import annotations

import torch

from r3trace.engine.request import SamplingParams


class Sampler:
    def __init__(self, device: str, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def request_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """logits: [B, V] float32 -> next token ids [B] int64."""
        greedy_ids = logits.argmax(dim=-1)  # [B]
        if all(p.is_greedy for p in params):
            return greedy_ids
        device = logits.device
        temps = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params], device=device)
        logits = logits / temps[:, None]  # [B, V]
        if any(p.top_k != -1 for p in params):
            logits = _apply_top_k(logits, [p.top_k for p in params])
        probs = torch.softmax(logits, dim=-1)  # [B, V]
        if any(p.top_p < 1.0 for p in params):
            probs = _apply_top_p(probs, torch.tensor([p.top_p for p in params], device=device))
        q = torch.empty_like(probs)  # [B, V] Exp(1) noise
        shared_rows = [i for i, g in enumerate(generators) if g is None]
        if shared_rows:
            q[shared_rows] = torch.empty(len(shared_rows), probs.shape[1], device=device).exponential_(
                generator=self.generator
            )
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        sampled = (probs / q).argmax(dim=-1)  # [B]
        is_greedy = torch.tensor([p.is_greedy for p in params], device=device)
        return torch.where(is_greedy, greedy_ids, sampled)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Keep the k largest logits per row (-1: all); ties at the k-th value are kept too."""
    vocab = logits.shape[1]
    k = torch.tensor([vocab if t == -1 else min(t, vocab) for t in top_ks], device=logits.device)  # [B]
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [B, V]
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the top one)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # [B, V] mass of strictly more likely tokens
    drop_sorted = mass_before >= top_ps[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)
