"""SGLang's logits processors that read a request's output so far: repetition, frequency and presence penalties,
and min_new_tokens. They act on the logits before temperature, so greedy rows are penalised too.

B sampling rows, V vocabulary, R request rows (req_to_token's). The contract, as SGLang's penaltylib applies it
(tests/engine/test_penalties.py names the files and commits):
  - only output tokens count, never the prompt;
  - additive terms first: logit -= frequency_penalty * count, logit -= presence_penalty where count > 0, and
    logit = -inf on the request's stop_token_ids and the model's EOS ids while it has output fewer than
    min_new_tokens tokens;
  - then repetition: where count > 0 a logit is divided by repetition_penalty when > 0, multiplied otherwise;
  - last, the request's logit_bias is added (SGLang's apply_logits_bias adds it after the penalizers). It reads
    no counts, but it is per-request logits processing of the same kind, so it rides the same step and copies.

State. `counts[r, t]`: how often the request holding row r output token t, [R, V] float32 on the device, allocated
on the first step with a penalty (64 rows x 129,280 tokens of DeepSeek-V3: 33 MB). The request's output_ids on the
host are what survives retraction: its row is rebuilt from them at its first sample after each (re)admission, then
every step adds the sampled tokens on the device. So a step scheduled ahead (engine/model_runner.py), whose
previous token the host has not seen yet, still counts it, and no step waits for the host: the per-step inputs go
through the sampler's pinned staging (two copies), and every op has a host-known shape (flat index_add_ and
index_fill, never a boolean index).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from r3trace.engine.request import SamplingParams
from r3trace.engine.step import ScheduledReq

Stage = Callable[[np.ndarray], torch.Tensor]  # HostStaging.to_device


@dataclass(frozen=True)
class PenaltyRow:
    """One sampling row's host inputs."""

    params: SamplingParams
    row: int  # the request's req_to_token row: its counts live there
    num_out: int  # tokens it output before the one sampled now (one in flight on a step ahead included)
    history: Sequence[int] | None  # all its output ids when its counts row must be rebuilt, else None


def penalty_rows(items: Sequence[ScheduledReq]) -> list[PenaltyRow] | None:
    """The step's rows, or None when no request of the step has a penalty, a logit_bias or a min_new_tokens still
    ahead of it:
    the batch-level check that keeps the common step free of penalty work. A request's first sample since its
    (re)admission is phase "prefill" (engine/scheduler.py): all its outputs are on the host then (a step ahead is
    always "decode"), and its row may hold another request's counts, so it is rebuilt."""

    def num_out(it: ScheduledReq) -> int:
        return len(it.req.output_ids) + it.ahead

    if not any(it.req.params.has_penalty or it.req.params.logit_bias or num_out(it) < it.req.params.min_new_tokens
               for it in items):
        return None
    return [PenaltyRow(it.req.params, it.req.pool_row, num_out(it),
                       it.req.output_ids if it.phase == "prefill" else None) for it in items]


class PenaltyStep:
    """One step's penalties, on the device: `apply` before sampling, `record` after."""

    def __init__(
        self, counts: torch.Tensor | None, rows: torch.Tensor, coef: torch.Tensor | None,
        banned: torch.Tensor | None, has: tuple[bool, bool, bool],
        bias: tuple[torch.Tensor, torch.Tensor] | None = None, prior: torch.Tensor | None = None,
    ) -> None:
        self.counts = counts  # [R, V] float32, None when no row has a counting penalty
        self.rows = rows  # [B] int64: each sampling row's counts row
        self.coef = coef  # [3, B] float32: frequency, presence, repetition penalty
        self.banned = banned  # [n] int64 flat b * V + token: -inf until min_new_tokens
        self.has_freq, self.has_pres, self.has_rep = has
        self.bias = bias  # ([n] int64 flat b * V + token, [n] float32 bias), None when no row has a logit_bias
        # [m] int64 flat b * V + token: tokens row b counts once more than its request's counts row holds (a verify
        # row's drafts before it, engine/spec/penalised.py); None in plain decoding
        self.prior = prior

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] float32 -> penalised logits [B, V] (a new tensor: the raw ones serve prompt logprobs)."""
        out = logits
        seen = None
        if self.counts is not None:
            assert self.coef is not None
            cnt = self.counts.index_select(0, self.rows)  # [B, V]
            if self.prior is not None:
                cnt.view(-1).index_add_(0, self.prior, torch.ones_like(self.prior, dtype=cnt.dtype))
            seen = cnt > 0
            if self.has_freq:
                out = out - self.coef[0, :, None] * cnt
            if self.has_pres:
                out = out - self.coef[1, :, None] * seen
        if self.banned is not None:
            out = out.reshape(-1).index_fill(0, self.banned, float("-inf")).view(logits.shape)
        if self.has_rep:
            assert self.coef is not None and seen is not None
            rep = self.coef[2, :, None]  # [B, 1]
            out = torch.where(seen, torch.where(out < 0, out * rep, out / rep), out)
        if self.bias is not None:
            where, value = self.bias
            out = out.reshape(-1).index_add(0, where, value).view(logits.shape)
        return out

    def record(self, next_ids: torch.Tensor) -> None:
        """Count the tokens just sampled ([B] int64) in their requests' rows."""
        if self.counts is not None:
            flat = self.rows * self.counts.shape[1] + next_ids  # [B]
            self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=self.counts.dtype))


class Penalties:
    """The output counts of every request row, and each step's PenaltyStep built from them."""

    def __init__(self, num_rows: int, vocab: int, eos_token_ids: Sequence[int], device: str | torch.device) -> None:
        self.num_rows, self.vocab, self.device = num_rows, vocab, device
        self.eos_token_ids = tuple(eos_token_ids)  # banned with each request's stop_token_ids under min_new_tokens
        self.counts: torch.Tensor | None = None  # [R, V] float32, from the first step that counts

    def step(self, rows: Sequence[PenaltyRow], stage: Stage) -> PenaltyStep | None:
        counting = any(r.params.has_penalty for r in rows)
        banned = [b * self.vocab + t for b, r in enumerate(rows) if r.num_out < r.params.min_new_tokens
                  for t in sorted(set(r.params.stop_token_ids) | set(self.eos_token_ids))]
        biased = [(b * self.vocab + t, v) for b, r in enumerate(rows) for t, v in r.params.logit_bias]
        if not counting and not banned and not biased:
            return None
        # only rows with a penalty: the others' counts may be stale, and their neutral coefficients ignore them
        rebuild = [r for r in rows if r.history is not None and r.params.has_penalty]
        history = [r.row * self.vocab + t for r in rebuild for t in r.history or ()]
        # one int64 copy: [B counts rows | rows to rebuild | their history, flat row * V + token | banned, flat |
        # biased, flat b * V + token]
        sizes = [len(rows), len(rebuild), len(history), len(banned), len(biased)]
        dev = stage(np.array([r.row for r in rows] + [r.row for r in rebuild] + history + banned
                             + [i for i, _ in biased], np.int64))
        at = np.cumsum([0, *sizes])
        rows_t, rebuild_t, history_t, banned_t, biased_t = (dev[at[i] : at[i + 1]] for i in range(5))
        # one float32 copy: [3 * B coefficients when counting | the biases]
        coef_host = np.array([[r.params.frequency_penalty, r.params.presence_penalty, r.params.repetition_penalty]
                              for r in rows], np.float32).T if counting else np.zeros((3, 0), np.float32)  # [3, B]
        floats = stage(np.concatenate([coef_host.reshape(-1), np.array([v for _, v in biased], np.float32)])) \
            if counting or biased else None
        counts = coef = None
        has = (False, False, False)
        if counting:
            if self.counts is None:
                self.counts = torch.zeros(self.num_rows, self.vocab, dtype=torch.float32, device=self.device)
            counts = self.counts
            if rebuild:
                counts.index_fill_(0, rebuild_t, 0.0)
                counts.view(-1).index_add_(0, history_t, torch.ones_like(history_t, dtype=counts.dtype))
            assert floats is not None
            coef = floats[: 3 * len(rows)].view(3, len(rows))
            has = (bool(coef_host[0].any()), bool(coef_host[1].any()), bool((coef_host[2] != 1).any()))
        bias = (biased_t, floats[coef_host.size :]) if biased and floats is not None else None
        return PenaltyStep(counts, rows_t, coef, banned_t if banned else None, has, bias)
