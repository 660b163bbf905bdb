"""One step's contract between the Scheduler (what to compute) and the ModelRunner (what came out)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from r3trace.engine.forward_batch import Phase
from r3trace.engine.request import LogprobEntry, Req


@dataclass
class ScheduledReq:
    """One request's share of a step: positions start .. start+extend_len-1 are computed."""

    req: Req
    start: int
    extend_len: int
    out_cache_loc: np.ndarray  # [extend_len] int64 host: KV slot of each new position
    sample: bool  # the chunk completes the fill: the next token is sampled from its last row
    logprob_positions: range  # positions whose logits score the next prompt token
    phase: Phase
    # Scheduled one step ahead: the input is the token the previous, still running, step samples; the runner
    # reads it on the device (the host does not know it yet).
    ahead: bool = False
    # phase "verify" (speculative decoding): positions start.. hold the last sampled token, then draft_len draft
    # tokens the runner proposes; the verify forward accepts a prefix of them plus one token of the target's
    draft_len: int = 0
    # a chained launch's verify (EngineConfig.speculative_launch_steps S > 1): the KV slots of positions start ..
    # start + S * extend_len - 1, reserved for its S steps (out_cache_loc: the first step's extend_len of them)
    chain_slots: np.ndarray | None = None
    # one step of a chained launch before its last: the request's pages past it hold the later steps' KV, so
    # processing it frees none (the last step's processing trims them)
    more_steps: bool = False

    @property
    def end(self) -> int:
        return self.start + self.extend_len


@dataclass
class ReqOutput:
    """What a forward produced for one ScheduledReq (host values)."""

    next_token: int | None = None
    next_logprob: float | None = None
    next_top: list[LogprobEntry] | None = None
    input_logprobs: list[float] | None = None  # one per logprob_positions entry
    input_tops: list[list[LogprobEntry]] | None = None
    # token_ids_logprob: the listed ids' entries at the sampled position / at each logprob position
    next_ids_lp: list[LogprobEntry] | None = None
    input_ids_lps: list[list[LogprobEntry]] | None = None
    # a verify item's tokens in order (accepted drafts, then the target's own), with their logprobs when asked
    next_tokens: list[int] | None = None
    next_logprobs: list[float] | None = None
    next_tops: list[list[LogprobEntry]] | None = None
    next_ids_lps: list[list[LogprobEntry]] | None = None


def top_entries(values: Sequence[float], ids: Sequence[int], k: int) -> list[LogprobEntry]:
    """A logits row's k top logprobs (values and token ids, best first) as (logprob, token id, None) entries."""
    return [(v, i, None) for v, i in zip(values[:k], ids[:k], strict=True)]


def listed_entries(values: Sequence[float], ids: tuple[int, ...]) -> list[LogprobEntry]:
    """A logits row's logprobs of a request's listed token ids (token_ids_logprob) as entries, in the list's order."""
    return [(v, i, None) for v, i in zip(values[: len(ids)], ids, strict=True)]


def fill_input_logprobs(out: ReqOutput, it: ScheduledReq, in_lp: list, lp_pos: int,
                        top_row: Callable[[int], tuple[Sequence[float], Sequence[int]]],
                        ids_row: Callable[[int], Sequence[float]]) -> int:
    """out's input logprobs at the logprob positions of item `it`, the step's logprob rows lp_pos .. lp_pos + n: their
    values from in_lp, the top entries where the request asks for them (row j's values and ids: top_row(j)) and its
    listed ids' (row j's values: ids_row(j)) -> n. The runner and the speculative runner keep these rows apart."""
    n = len(it.logprob_positions)
    if not n:
        return 0
    lp = it.req.logprob
    k, ids = (lp.top_num, lp.token_ids) if lp is not None else (0, ())
    out.input_logprobs = in_lp[lp_pos : lp_pos + n]
    if k:
        out.input_tops = [top_entries(*top_row(j), k) for j in range(lp_pos, lp_pos + n)]
    if ids:
        out.input_ids_lps = [listed_entries(ids_row(j), ids) for j in range(lp_pos, lp_pos + n)]
    return n
