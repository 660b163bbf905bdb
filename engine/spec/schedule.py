"""Speculative decoding's part of the scheduler (scheduler.py): the verify items of a step whose every running request
decodes, the draft count of one verify, and the acceptance of a verify's sampled tokens.

Runs on the scheduler thread. A verify item holds a request's last token and d <= spec_steps drafts (d + 1 KV
positions); a chained launch (launch_steps S > 1) books S x (d + 1) positions at once and verifies d + 1 of them a
step. `accept` keeps the accepted tokens under the stop rules and tells the hooks which positions to drop
(RequestHooks.on_reject), before any hook of the step reads the forward's routes.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

import numpy as np

from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.kv_allocator import KVAllocator
from r3trace.engine.request import FinishReason, Req
from r3trace.engine.request_hooks import RequestHooks
from r3trace.engine.step import ReqOutput, ScheduledReq
from r3trace.engine.stop_rules import finish_reason, none_can_finish
from r3trace.engine.tokenizer import TextTokenizer


class VerifySchedule:
    """item(req, slots): the scheduler's ScheduledReq for req over those KV slots (it books them on the request)."""

    def __init__(self, kv: KVAllocator, config: EngineConfig, max_context_len: int,
                 item: Callable[[Req, np.ndarray], ScheduledReq]) -> None:
        self.kv = kv
        self.spec_steps = config.spec_steps  # d: drafts a verify holds at most
        self.launch_steps = config.launch_steps  # S: steps a launch chains on the device (only the graphs chain)
        self.max_running = config.max_running_requests
        self.max_context_len = max_context_len
        self.item = item

    def grow(self, running: list[Req], budget: int) -> list[ScheduledReq]:
        """Every running request decoding: the verify items of all of them at once, exactly what the per-request
        loop of Scheduler.schedule gives when the step's budget and the free pages hold every request's d + 1
        positions (no draft cut, no eviction, no retraction); [] otherwise (the loop then runs). Their slots come
        from KVAllocator.grow_all: one page allocation and one req_to_token write for the step."""
        ctx = self.max_context_len
        wants = [1 + max(0, min(self.spec_steps, ctx - r.seq_len - 1)) for r in running]
        if sum(wants) > budget:
            return []
        slots = self.kv.grow_all(running, wants)
        if slots is None:
            return []
        items = []
        at = 0
        for req, want in zip(running, wants, strict=True):
            items.append(self.item(req, slots[at : at + want]))
            at += want
        return items

    def chain(self, running: list[Req], waiting: deque[Req], budget: int) -> list[ScheduledReq]:
        """A chained launch (S > 1), when every running request can run S greedy steps of d drafts on the device
        without the host between them: greedy with nothing that reads output counts (penalties, bias, a
        min_new_tokens ahead), no logprobs or forced routes, room for S x (d + 1) more positions, and no waiting
        request that could take a seat (it would wait S steps). Each request's S x (d + 1) slots are reserved at
        once; [] otherwise (a step of one)."""
        s, n = self.launch_steps, 1 + self.spec_steps
        if s == 1 or len(running) * n > budget:
            return []
        if waiting and len(running) < self.max_running:
            return []
        for r in running:
            p = r.params
            if (not p.is_greedy or p.has_penalty or p.logit_bias or len(r.output_ids) < p.min_new_tokens
                    or r.logprob is not None or r.replay is not None or r.seq_len + s * n > self.max_context_len):
                return []
        slots = self.kv.grow_all(running, [s * n] * len(running))
        if slots is None:
            return []
        items = []
        for i, req in enumerate(running):  # item books all S x n positions; a step verifies n of them
            reserved = slots[i * s * n : (i + 1) * s * n]
            items.append(dataclasses.replace(self.item(req, reserved), extend_len=n, out_cache_loc=reserved[:n],
                                             draft_len=n - 1, chain_slots=reserved))
        return items

    def draft_len(self, req: Req, budget: int) -> int:
        """Draft tokens a decoding request verifies this step: d, fewer only when the context limit or the step's
        token budget is short. A request near max_new_tokens still verifies d drafts: the stop rule drops tokens
        past its limit (`accept` frees their KV), and the step keeps the uniform d + 1 rows a request that its CUDA
        graphs need (a step with one shorter verify ran eager: about 45% of the steps at batch 32 on the sample
        model, each ~10x a graph step's time)."""
        return max(0, min(self.spec_steps, self.max_context_len - req.seq_len - 1, budget - 1))


def accept(item: ScheduledReq, out: ReqOutput, eos_token_ids: frozenset[int], tokenizer: TextTokenizer,
           max_context_len: int, hooks: RequestHooks) -> FinishReason | None:
    """A verify item's tokens, appended one at a time under the stop rules (a stop drops the tokens after it); the
    KV of every position past them is freed after the step's last accept (Scheduler.process): rejected drafts, and
    drafts accepted after a stop. -> the request's finish reason, None while it runs on."""
    req = item.req
    assert out.next_tokens is not None
    req.inflight = 0  # a verify is its request's one step in flight (a chained launch's: each step ends it)
    req.spec_verify_ct += 1
    # drafts that could become output: one token of the verify is the target's, none past max_new_tokens
    req.spec_num_proposed_drafts += min(item.draft_len, req.params.max_new_tokens - len(req.output_ids) - 1)
    tokens = out.next_tokens
    stop = None
    if none_can_finish(req, tokens, eos_token_ids, max_context_len):
        req.output_ids += tokens
        appended = len(tokens)
    else:
        appended = 0
        for tok in tokens:
            appended += 1
            req.output_ids.append(tok)
            stop = finish_reason(req, eos_token_ids, tokenizer, max_context_len)
            if stop is not None:
                break
    if req.logprob is not None and out.next_logprobs is not None:
        for j, tok in enumerate(tokens[:appended]):
            req.output_logprobs.append((out.next_logprobs[j], tok, None))
            if out.next_tops is not None:
                req.output_top_logprobs.append(out.next_tops[j])
            if out.next_ids_lps is not None:
                req.output_token_ids_logprobs.append(out.next_ids_lps[j])
    req.spec_num_correct_drafts += appended - 1  # drafts that became output (accepted after a stop: dropped)
    kept = req.seq_len - 1 - item.start  # positions start.. whose input token is committed: one per token kept
    req.kv_len = item.start + kept
    hooks.on_reject(req, item.start, kept, item.out_cache_loc[kept:])
    return stop
