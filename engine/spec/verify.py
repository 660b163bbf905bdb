"""Acceptance of a verify forward: which draft tokens stand, and the target's token after them.

Shape legend: B requests that sample this step, d the step's most drafts per request (rows 0..d of each request's
verify are its d + 1 positions), V vocab. Request b has draft_lens[b] <= d drafts (0: a prefill's last row, which
simply samples); drafts past it are padding and never accepted.

Greedy (SGLang's verify_tree_greedy on a chain): draft j stands while every draft before it did and it equals the
target's argmax at row j - 1; the token after the accepted a drafts is the argmax at row a. The committed tokens are
then exactly the target's own greedy tokens, the same as decoding without speculation.

Sampled (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1; SGLang's
tree_speculative_sampling_target_only with a sampled draft): draft x_j, drawn from the draft's q_j, stands with
probability min(1, p_j(x_j) / q_j(x_j)), p_j the target's distribution at row j - 1 under the request's temperature,
top-k and top-p (Sampler.probs); at the first rejection the token is drawn from max(p - q, 0) renormalised, and when
every draft stands from p at the last row. Each committed token is then distributed exactly as p given the ones
before it (tests/spec/test_spec_sampling.py checks it with a chi-square test).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Accepted(NamedTuple):
    tokens: torch.Tensor  # [B, d + 1] int64: the accepted drafts then the target's token; the first counts[b] count
    counts: torch.Tensor  # [B] int64: accepted drafts + 1 (the index of the last token is counts - 1)


def accept_greedy(target_ids: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor) -> Accepted:
    """target_ids: [B, d + 1] the target's argmax at each verify row; drafts: [B, d]; draft_lens: [B]."""
    d = drafts.shape[1]
    valid = torch.arange(d, device=drafts.device)[None, :] < draft_lens[:, None]  # [B, d]
    match = (drafts == target_ids[:, :d]) & valid
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [B] the longest matching prefix
    # Row j < accepted holds draft j + 1 == the target's argmax at j; row `accepted` the target's own: target_ids.
    return Accepted(target_ids, accepted + 1)


def accept_sampled(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor, u: torch.Tensor,
    race: torch.Tensor,
) -> Accepted:
    """p: [B, d + 1, V] the target's distributions at the verify rows; q: [B, d, V] the draft's, from which drafts
    [B, d] were drawn; u: [B, d] U[0, 1) draws; race: [B, V] Exp(1) draws for the last token (argmax of weight /
    race draws from weight, as Sampler.race)."""
    b, d = drafts.shape
    rows = torch.arange(b, device=p.device)
    valid = torch.arange(d, device=p.device)[None, :] < draft_lens[:, None]  # [B, d]
    if d:
        p_x = p[:, :d].gather(2, drafts[:, :, None])[:, :, 0]  # [B, d] p_j(x_j)
        q_x = q.gather(2, drafts[:, :, None])[:, :, 0]  # [B, d] q_j(x_j) > 0: x_j was drawn from q_j
        stands = (u * q_x < p_x) & valid  # u < p / q, without the division: p >= q always stands (u < 1)
        accepted = stands.long().cumprod(dim=1).sum(dim=1)  # [B]
    else:
        accepted = torch.zeros(b, dtype=torch.int64, device=p.device)
    p_last = p[rows, accepted]  # [B, V] the target's distribution at the row after the accepted drafts
    rejected = accepted < draft_lens  # [B] a draft at `accepted` was drawn and rejected: sample the residual
    if d:
        q_at = q[rows, accepted.clamp(max=d - 1)]  # [B, V]
        residual = (p_last - q_at).clamp(min=0.0)
        # p == q makes the residual 0 (a rejection then has probability 0; guard the division anyway)
        empty = residual.sum(dim=1, keepdim=True) <= 0
        weight = torch.where(rejected[:, None] & ~empty, residual, p_last)
    else:
        weight = p_last
    last = (weight / race).argmax(dim=1)  # [B] (weight need not sum to 1: the race normalises)
    tokens = torch.cat([drafts, drafts.new_zeros(b, 1)], dim=1)  # [B, d + 1]
    tokens[rows, accepted] = last
    return Accepted(tokens, accepted + 1)
