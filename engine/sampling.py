"""Next-token sampling for one step: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds.

B rows (one per request that samples this step), V vocabulary. Sampling is an exponential race,
argmax(probs / q) with q ~ Exp(1), which draws exactly from `probs`. Each seeded request draws its
V exponentials from its own torch.Generator, so its tokens do not depend on the other rows of the
batch; unseeded rows share the engine's generator in one call. Nothing here syncs with the host: the per-row
parameters go to the device through pinned staging (engine/host_staging.py), never `torch.tensor(..., device=)`,
a blocking copy that would make the overlapped scheduler wait for the step before (temperature sampling is the
common case of RL rollouts).

SGLang's order: the penalties, min_new_tokens and logit_bias (engine/penalties.py) on the logits, then greedy rows
take the argmax; the others divide by the temperature, keep the top-k logits, softmax, keep the top-p nucleus, then
drop the tokens below min_p times the most likely one. Each stage runs only when a row of the step asks for it.

Output logprobs, SGLang's default (layers/sampler.py Sampler.forward without SGLANG_RETURN_ORIGINAL_LOGPROB): the
log-softmax of the logits the row samples from, after the penalties, min_new_tokens and logit_bias and divided by
the temperature (1 for greedy rows, as SGLang sets greedy requests' temperature to 1), before top-k, top-p and
min-p. `scored_logits` gives those logits; prompt logprobs stay the model's raw log-softmax, as in SGLang.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import torch

from r3trace.engine.host_staging import HostStaging
from r3trace.engine.penalties import PenaltyStep
from r3trace.engine.request import SamplingParams


class Sampled(NamedTuple):
    ids: torch.Tensor  # [B] int64
    scored: torch.Tensor | None  # [B, V] float32: output logprobs are its log-softmax; None: the raw logits'


class Sampler:
    def __init__(self, device: str, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # up to 9 copies a sampling step (temperatures, top-k, top-p, min-p, the shared rows, the greedy mask,
        # engine/penalties.py's indices, and its coefficients and biases, and the temperatures of scored output
        # logprobs): 27 buffers come back after 3 steps, when the host has long waited for those steps' results
        self.staging = HostStaging(device, num_buffers=27)

    def request_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
        penalty: PenaltyStep | None = None,
    ) -> torch.Tensor:
        """logits: [B, V] float32 -> next token ids [B] int64. `penalty`: the step's penalties, None when no row
        has one (Penalties.step); the sampled tokens are counted in it."""
        return self.sample_scored(logits, params, generators, penalty, scored=False).ids

    def sample_scored(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
        penalty: PenaltyStep | None = None, *, scored: bool,
    ) -> Sampled:
        """As `sample`; with `scored` also the logits whose log-softmax are the rows' output logprobs (None when
        they are the raw `logits`: no penalty and every temperature 1 or greedy, so no [B, V] copy is made)."""
        if penalty is not None:
            logits = penalty.apply(logits)  # [B, V], before the argmax and the temperature
        ids = self._draw(logits, params, generators)
        if penalty is not None:
            penalty.record(ids)
        return Sampled(ids, self.scored_logits(logits, params, penalty is not None) if scored else None)

    def scored_logits(
        self, logits: torch.Tensor, params: list[SamplingParams], penalised: bool = True
    ) -> torch.Tensor | None:
        """[B, V] penalised logits -> the same over each row's temperature (greedy rows: 1), or None when that is
        `logits` unchanged and `penalised` is false (the caller's raw logits serve)."""
        if all(p.is_greedy or p.temperature == 1.0 for p in params):
            return logits if penalised else None
        temps = self.staging.to_device(np.array([1.0 if p.is_greedy else p.temperature for p in params],
                                                np.float32))  # [B]
        return logits / temps[:, None]

    def _draw(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1)  # [B]
        if all(p.is_greedy for p in params):
            return greedy_ids
        sampled = self.race(self.probs(logits, params), generators)  # [B]
        is_greedy = self.staging.to_device(np.array([p.is_greedy for p in params], np.bool_))  # [B]
        return torch.where(is_greedy, greedy_ids, sampled)

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """logits: [B, V] float32 -> the distribution each row samples from [B, V]: softmax of logits / temperature
        (1 for greedy rows) after top-k, then top-p and min-p. Speculative decoding's acceptance reads it too
        (spec/verify.py)."""
        vocab = logits.shape[1]
        stage = self.staging.to_device
        temps = stage(np.array([p.temperature if not p.is_greedy else 1.0 for p in params], np.float32))  # [B]
        logits = logits / temps[:, None]  # [B, V]
        if any(p.top_k != -1 for p in params):
            logits = _apply_top_k(logits, stage(np.array([vocab if p.top_k == -1 else min(p.top_k, vocab)
                                                          for p in params], np.int64)))
        probs = torch.softmax(logits, dim=-1)  # [B, V]
        if any(p.top_p < 1.0 for p in params):
            probs = _apply_top_p(probs, stage(np.array([p.top_p for p in params], np.float32)))
        if any(p.min_p > 0 for p in params):
            probs = _apply_min_p(probs, stage(np.array([p.min_p for p in params], np.float32)))
        return probs

    def race(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """probs: [B, V] (need not sum to 1) -> one draw per row [B] int64: argmax(probs / q), q ~ Exp(1)."""
        return (probs / self.noise(probs.shape, generators, "exponential")).argmax(dim=-1)

    def noise(
        self, shape: torch.Size | tuple[int, int], generators: list[torch.Generator | None],
        kind: Literal["exponential", "uniform"],
    ) -> torch.Tensor:
        """[B, n] float32 draws, Exp(1) or U[0, 1): row b from generators[b] (a seeded request), the others from the
        engine's generator in one call (row order)."""
        draw = torch.Tensor.exponential_ if kind == "exponential" else torch.Tensor.uniform_
        rows, n = shape
        q = torch.empty(rows, n, device=self.device)
        shared_rows = [i for i, g in enumerate(generators) if g is None]
        if len(shared_rows) == len(generators):  # the same draws as the branch below, without an index
            draw(q, generator=self.generator)
        elif shared_rows:
            draws = draw(torch.empty(len(shared_rows), n, device=self.device), generator=self.generator)
            q.index_copy_(0, self.staging.to_device(np.array(shared_rows, np.int64)), draws)
        for i, g in enumerate(generators):
            if g is not None:
                draw(q[i], generator=g)
        return q


def _apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep the k[b] largest logits of row b (k: [B] int64, 1..V); ties at the k-th value are kept too."""
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


def _apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop the tokens of row b whose probability is below min_ps[b] times the row's largest (min_ps: [B] float32);
    the largest is never dropped, and top-k / top-p never drop it, so it is the same before or after them."""
    top = probs.max(dim=-1, keepdim=True).values  # [B, 1]
    return probs.masked_fill(probs < top * min_ps[:, None], 0.0)
