"""Scheduler: which requests run in the next forward, how many tokens each, and where their KV goes.

One step = one forward that mixes decode tokens and prefill chunks under a budget of
`chunked_prefill_size` new tokens:
  1. running requests, oldest first, each extends by what its fill still lacks (1 for decode, the rest
     of a chunked prompt otherwise), while the budget lasts. A running request that gets no KV page,
     even after evicting the prefix cache, retracts the newest running request (its KV freed, itself
     re-queued at the front to re-prefill prompt + tokens generated so far).
  2. if nothing was retracted, waiting requests are admitted first-come first-served: prefix-cache
     match, then a prefill chunk of what the budget and the free pages allow.
`process` then appends the sampled tokens, applies the stop rules and frees the finished requests.

Where each request's KV goes (admission with the prefix match, growth, release to the prefix cache) is
`KVAllocator`'s (kv_allocator.py). Capture plugs in through `RequestHooks` (all called on the scheduler thread,
KV still valid): on_admit after the prefix match, on_retract and on_finish before the request's KV is freed. A
forward's end is the recorder's on_forward_end, which the model calls. Under speculative decoding a decoding
request's step is a verify: its items and draft counts are VerifySchedule's, its tokens kept by `accept`
(spec/schedule.py).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.kv_allocator import KVAllocator
from r3trace.engine.kv_pool import KVPool, ReqToTokenPool
from r3trace.engine.radix_cache import RadixCache
from r3trace.engine.request import FinishReason, LogprobEntry, Req
from r3trace.engine.request_hooks import NullHooks, RequestHooks
from r3trace.engine.spec.schedule import VerifySchedule, accept
from r3trace.engine.step import ReqOutput, ScheduledReq
from r3trace.engine.stop_rules import finish_reason
from r3trace.engine.tokenizer import TextTokenizer


class Scheduler:
    def __init__(
        self, config: EngineConfig, pool: KVPool, req_pool: ReqToTokenPool, cache: RadixCache | None,
        tokenizer: TextTokenizer, eos_token_ids: tuple[int, ...], max_context_len: int,
        hooks: RequestHooks | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.req_pool = req_pool
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context_len = max_context_len
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admission order: the last one is the newest
        self._updates: list[Req] = []  # requests with news since the last take_updates()
        self.hooks: RequestHooks = hooks or NullHooks()
        self.kv = KVAllocator(pool, req_pool, cache, self.hooks)  # where each request's KV goes (kv_allocator.py)
        self.num_retractions = 0  # over the scheduler's life: tests check preemption really happened
        self.num_dropped_ahead = 0  # positions computed ahead for requests that had stopped (tests check it)
        # Speculative decoding: a decoding request verifies up to spec_steps draft tokens a step (0: off), in launches
        # of up to VerifySchedule.launch_steps steps chained on the device (1: one step a launch; only the graphs chain)
        self.spec_steps = config.spec_steps
        self.verifies = VerifySchedule(self.kv, config, max_context_len, self._item)  # spec/schedule.py

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_updates(self) -> list[Req]:
        """Requests changed since the last call, each once (a chained launch's steps add one several times)."""
        out, self._updates = self._updates, []
        return list({id(r): r for r in out}.values())

    def abort(self, rid: str, message: str = "aborted by the client") -> bool:
        for req in list(self.waiting) + self.running:
            if req.rid == rid and not req.finished:
                self._finish(req, FinishReason("abort", message=message))
                return True
        return False

    def abort_all(self, message: str, is_error: bool = False) -> None:
        for req in list(self.waiting) + list(self.running):
            self._finish(req, FinishReason("abort", message=message, is_error=is_error))

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> list[ScheduledReq]:
        budget = self.config.chunked_prefill_size
        items: list[ScheduledReq] = []
        retracted = False
        # Speculation: drafts take only what the budget has left after one token for every decoding request behind
        # this one, so a request never waits a step for another's drafts.
        decoding_after = sum(r.in_decode for r in self.running) if self.spec_steps else 0
        i = 0
        if self.spec_steps and self.running and decoding_after == len(self.running):
            items = self.verifies.chain(self.running, self.waiting, budget) or self.verifies.grow(self.running, budget)
            budget -= sum(it.extend_len for it in items)
            i = len(items)
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = min(req.seq_len - req.kv_len, budget)
            if self.spec_steps and req.in_decode:
                decoding_after -= 1
                want = 1 + self.verifies.draft_len(req, budget - decoding_after)
            slots = self.kv.grow(req, want)
            while slots is None:
                victim = self.running[-1]
                if len(self.running) == 1:  # alone and still out of pages: the pool cannot hold it
                    reason = FinishReason("abort", message=self.kv.pool_full_message(req), is_error=True)
                    self._finish(req, reason)
                    break
                self._retract(victim)
                retracted = True
                if victim is req:
                    break
                slots = self.kv.grow(req, want)
            if slots is None:
                continue  # req left `running`; running[i] is now the next one
            items.append(self._item(req, slots))
            budget -= len(slots)
            i += 1
        max_running = self.config.max_running_requests
        while not retracted and self.waiting and budget > 0 and len(self.running) < max_running:
            req = self.waiting[0]
            slots = self.kv.admit(req, budget)
            if slots is None:
                break  # first come first served: no overtaking a request that does not fit
            self.waiting.popleft()
            self.running.append(req)
            items.append(self._item(req, slots))
            budget -= len(slots)
        # decodes and verifies first, prompt chunks after (a stable sort: each group keeps its order), so a step's
        # decode rows are its leading rows (ForwardBatch.lead_rows: the row-invariant MLA's absorbed half)
        items.sort(key=lambda it: it.phase == "prefill")
        return items

    def schedule_ahead(self, prev: list[ScheduledReq]) -> list[ScheduledReq] | None:
        """The overlapped scheduler's next step, built while `prev` (launched, not yet processed) runs: the
        decode step `schedule` would return once prev is processed, assuming no request stops on a sampled
        token (process rolls those back). Every running request sampled in prev and continues by one position
        whose input is prev's token; those prev surely finishes (length, context) are left out, as process
        would. None when the step needs prev's results first: an admission, a chunked prefill, a retraction
        or a cache eviction (the caller then processes prev and calls schedule)."""
        if self.spec_steps or (self.waiting and len(self.running) < self.config.max_running_requests):
            return None  # a speculative step needs the accepted lengths of the one before on the host
        prev_reqs = {id(it.req) for it in prev if it.sample}
        if len(prev_reqs) != len(self.running) or any(id(r) not in prev_reqs for r in self.running):
            return None
        keep = [r for r in self.running
                if len(r.output_ids) + 1 < r.params.max_new_tokens and r.seq_len + 1 < self.max_context_len]
        if not keep or len(keep) > self.config.chunked_prefill_size:
            return None
        starts = [r.kv_len for r in keep]
        slots = self.kv.grow_all(keep, [1] * len(keep))  # [B]: one position each, for all requests at once
        if slots is None:
            return None  # the serial path evicts or retracts
        items = [ScheduledReq(req=r, start=p, extend_len=1, out_cache_loc=slots[i : i + 1], sample=True,
                              logprob_positions=range(0), phase="decode", ahead=True)
                 for i, (r, p) in enumerate(zip(keep, starts, strict=True))]
        for req in keep:
            req.kv_len += 1
            req.inflight += 1
        return items

    def _item(self, req: Req, slots: np.ndarray) -> ScheduledReq:
        start, n = req.kv_len, len(slots)
        req.kv_len += n
        req.inflight += n
        if self.spec_steps and req.in_decode:  # the slots of the last token and of n - 1 drafts
            return ScheduledReq(req=req, start=start, extend_len=n, out_cache_loc=slots, sample=True,
                                logprob_positions=range(0), phase="verify", draft_len=n - 1)
        fill_len = req.seq_len
        positions = range(0)
        if req.wants_input_logprobs:
            assert req.logprob is not None
            lo = max(req.logprob.start_len - 1, 0)  # logits at p score prompt token p + 1
            positions = range(max(lo, start), min(req.prompt_len - 1, start + n))
        return ScheduledReq(
            req=req,
            start=start,
            extend_len=n,
            out_cache_loc=slots,
            sample=start + n == fill_len and len(req.output_ids) < req.params.max_new_tokens,
            logprob_positions=positions,
            phase="decode" if req.in_decode else "prefill",
        )

    # ------------------------------------------------------------------ results
    def process(self, items: list[ScheduledReq], outputs: list[ReqOutput]) -> None:
        """Fold a forward's outputs into request state; finished requests release their KV."""
        # Verify items first, all of them: every rejected row is dropped (on_reject) before any hook of this step
        # reads or emits the forward's routes (a finishing request's on_finish drains the capturer's copy).
        verified = [(it, out) for it, out in zip(items, outputs, strict=True)
                    if it.phase == "verify" and not it.req.finished]
        stops = {id(it.req): accept(it, out, self.eos_token_ids, self.tokenizer, self.max_context_len, self.hooks)
                 for it, out in verified}
        # one free for the step: the pages past each kept position (after a chained launch's last step only)
        self.kv.trim([it.req for it, _ in verified if not it.more_steps])
        for item, out in zip(items, outputs, strict=True):
            req = item.req
            if req.finished:  # stopped at the step before, after this one was launched for it: dropped
                continue
            if item.phase == "verify":
                stop = stops[id(req)]
                if stop is not None:
                    self._finish(req, stop)
                else:
                    self._updates.append(req)
                continue
            req.inflight -= item.extend_len
            if out.input_logprobs is not None:
                tops: list[list[LogprobEntry] | None] = [None] * len(out.input_logprobs)
                if out.input_tops is not None:
                    tops = list(out.input_tops)
                for p, lp, top in zip(item.logprob_positions, out.input_logprobs, tops, strict=True):
                    req.input_logprobs.append((lp, req.origin_input_ids[p + 1], None))
                    req.input_top_logprobs.append(top)
                if out.input_ids_lps is not None:
                    req.input_token_ids_logprobs.extend(out.input_ids_lps)
            if req.logprob is not None and item.end >= req.prompt_len:
                req.input_logprobs_done = True
            if item.end == req.seq_len:
                req.in_decode = True
            if item.sample:
                assert out.next_token is not None
                req.output_ids.append(out.next_token)
                if req.logprob is not None:
                    req.output_logprobs.append((out.next_logprob, out.next_token, None))
                    if out.next_top is not None:
                        req.output_top_logprobs.append(out.next_top)
                    if out.next_ids_lp is not None:
                        req.output_token_ids_logprobs.append(out.next_ids_lp)
                finish = finish_reason(req, self.eos_token_ids, self.tokenizer, self.max_context_len)
                if finish is not None:
                    self._finish(req, finish)
                else:
                    self._updates.append(req)
            elif item.end == req.seq_len:  # max_new_tokens == 0: prefill only
                self._finish(req, FinishReason("length", length=len(req.output_ids)))

    # ------------------------------------------------------------------ lifecycle hooks
    def _finish(self, req: Req, reason: FinishReason) -> None:
        """The request is done; its KV (pages, pool_row) is still valid here, freed below."""
        req.finish = reason
        self._drop_ahead(req)
        self.hooks.on_finish(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.pool_row >= 0:
            self.kv.release(req, cache_it=True)
        self._updates.append(req)

    def _retract(self, req: Req) -> None:
        """Out of KV: drop req's KV, keep its outputs, re-queue it at the front (it is older than the
        waiting ones). Its KV is still valid on entry."""
        self._drop_ahead(req)
        self.hooks.on_retract(req)
        self.running.remove(req)
        self.kv.release(req, cache_it=False)
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def _drop_ahead(self, req: Req) -> None:
        """Positions of a step launched ahead were not computed for the request's history: forget them, so
        the hooks read only computed rows and the prefix cache never holds them (their pages go back to
        the pool with the rest; the step still writes them, before any later step reuses them)."""
        self.num_dropped_ahead += req.inflight
        req.kv_len -= req.inflight
        req.inflight = 0
