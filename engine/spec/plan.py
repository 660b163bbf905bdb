"""StepPlan: a speculative step's host layout (the rows of its target forward, logits, drafts and samplers), built by
plan_step from the scheduled items before anything reaches the device (SpecRunner._launch).

Shape legend: T tokens of the target forward, N logits rows, B requests that sample, d the step's most drafts per
request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..step import ScheduledReq


@dataclass
class StepPlan:
    """A step's host layout."""

    input_ids: list[int] = field(default_factory=list)  # [T]; a verify item's draft rows hold 0 until step 2
    logits_rows: list[int] = field(default_factory=list)  # [N] rows of T whose logits are computed
    lp_rows: list[int] = field(default_factory=list)  # input-logprob rows: indices into logits
    lp_targets: list[int] = field(default_factory=list)  # the prompt token each scores
    draft_dst: list[int] = field(default_factory=list)  # rows of T that take a draft token ...
    draft_src: list[int] = field(default_factory=list)  # ... from Drafter.tokens.view(-1) at this index
    samplers: list[ScheduledReq] = field(default_factory=list)  # items that sample, in order
    gather: list[int] = field(default_factory=list)  # [B * (d + 1)] the logits row of each sampler's verify row
    verify_row: list[int] = field(default_factory=list)  # [B] the T row of each sampler's first verify row
    draft_lens: list[int] = field(default_factory=list)  # [B]
    next_rows: list[int] = field(default_factory=list)  # rows of T whose next token the host knows (a chunk's last)
    next_ids: list[int] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return max(self.draft_lens, default=0)


def plan_step(items: list[ScheduledReq], steps: int) -> StepPlan:
    plan = StepPlan()
    first_logit: list[int] = []
    for it in items:
        base = len(plan.input_ids)
        if it.phase == "verify":  # its one known token, read without building fill_ids (a copy of every token)
            req, p = it.req, it.start
            plan.input_ids += [req.origin_input_ids[p] if p < req.prompt_len else req.output_ids[p - req.prompt_len]]
            plan.input_ids += [0] * it.draft_len
            plan.draft_dst += range(base + 1, base + 1 + it.draft_len)
            plan.draft_src += range(it.req.pool_row * steps, it.req.pool_row * steps + it.draft_len)
            fill: list[int] = []
        else:
            fill = it.req.fill_ids
            plan.input_ids += fill[it.start : it.end]
        for p in it.logprob_positions:
            plan.lp_rows.append(len(plan.logits_rows))
            plan.lp_targets.append(fill[p + 1])
            plan.logits_rows.append(base + p - it.start)
        if it.sample:
            plan.samplers.append(it)
            first_logit.append(len(plan.logits_rows))
            plan.verify_row.append(base + it.extend_len - 1 - it.draft_len)
            plan.draft_lens.append(it.draft_len)
            plan.logits_rows += range(plan.verify_row[-1], base + it.extend_len)
        else:  # the draft extend's last row reads the next prompt token (none after a prefill-only request's fill)
            plan.next_rows.append(base + it.extend_len - 1)
            plan.next_ids.append(fill[it.end] if it.end < len(fill) else 0)
    d = plan.depth
    plan.gather = [f + min(j, n) for f, n in zip(first_logit, plan.draft_lens, strict=True) for j in range(d + 1)]
    return plan
