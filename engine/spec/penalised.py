"""Penalties, min_new_tokens and logit_bias under speculation: each verify row processed exactly as plain decoding
processes the position it scores (engine/penalties.py holds SGLang's contract and the request counts rows).

Shape legend: B requests that sample this step, d the step's most drafts per request, V vocab, R request rows.

Row j (0..d) of request b's verify scores the position after drafts x_1..x_j. Plain decoding reaches that position
having output the request's tokens so far and then x_1..x_j, so the row is penalised as it would be there: its
counts are the request's counts row plus one of each draft before it, its output length (for min_new_tokens) is the
request's plus j, and its logit_bias is the request's. Greedy acceptance then compares each draft with the penalised
argmax, and rejection sampling divides the penalised p by the draft's q, so the committed tokens are the ones (greedy)
or are distributed as the ones (sampled) plain decoding gives: tests/spec/test_spec_penalties.py checks both. Rows
past a request's drafts are read by no acceptance. The drafts themselves come from the draft model's unprocessed
logits: a draft is q's draw, and q need not be p for the committed tokens to follow p (spec/verify.py); processing it
would only change how many drafts stand. After acceptance the committed tokens (counts[b] of request b) are added to
the request's counts row on the device, as Sampler.sample_scored records a plain step's sampled token.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ..penalties import Penalties, PenaltyStep, Stage, penalty_rows
from ..step import ScheduledReq


def verify_penalty(penalties: Penalties, samplers: list[ScheduledReq], drafts: torch.Tensor, stage: Stage
                   ) -> PenaltyStep | None:
    """The processing of the step's B * (d + 1) verify rows (row b * (d + 1) + j), or None when no request of the step
    has a penalty, a logit_bias or a min_new_tokens still ahead of it. drafts: [B, d] int64 on the device."""
    rows = penalty_rows(samplers)
    if rows is None:
        return None
    b, d = drafts.shape
    # a counts row is rebuilt from the request's history once, by its row 0
    per_row = [replace(r, num_out=r.num_out + j, history=None if j else r.history) for r in rows for j in range(d + 1)]
    step = penalties.step(per_row, stage)
    if step is None or step.counts is None or d == 0:
        return step
    j, i = np.tril_indices(d + 1, -1)  # (row j, draft i) with i < j: x_{i+1} is output before row j
    ji = stage(np.concatenate([j, i]).astype(np.int64))
    row_of = torch.arange(b, device=drafts.device)[:, None] * (d + 1) + ji[None, : len(j)]  # [B, d(d+1)/2]
    step.prior = (row_of * penalties.vocab + drafts[:, ji[len(j) :]]).reshape(-1)
    return step


def record_accepted(step: PenaltyStep | None, tokens: torch.Tensor, counts: torch.Tensor, req_rows: torch.Tensor
                    ) -> None:
    """Count the committed tokens: tokens [B, d + 1], the first counts[b] of row b committed; req_rows [B]."""
    if step is None or step.counts is None:
        return
    n, vocab = tokens.shape[1], step.counts.shape[1]
    keep = torch.arange(n, device=tokens.device)[None, :] < counts[:, None]  # [B, d + 1]
    flat = req_rows[:, None] * vocab + tokens.clamp(0, vocab - 1)  # [B, d + 1]
    step.counts.view(-1).index_add_(0, flat.reshape(-1), keep.reshape(-1).to(step.counts.dtype))
