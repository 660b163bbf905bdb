"""SpecRunner: one speculative step, launched and collected like ModelRunner's (one wait a step, at collect).

Shape legend: T tokens of the target forward, N logits rows, B requests that sample, d the step's most drafts per
request, V vocab, D hidden.

launch(items):
  1. chain drafts (Drafter.chain) for the verify items: x_2 .. x_{d'} at positions m .. m + d' - 2;
  2. the target forward: prefill chunks as without speculation, a verify item's d' + 1 rows [t_m, x_1 .. x_{d'}]
     (the drafts copied on the device into its rows), with logits at every verify row and the final hidden states
     of all rows; route capture records every row (phase "verify" for a verify item's);
  3. acceptance (verify.py): greedy or rejection sampling, per request; a prefill's last row is a verify of 0 drafts;
  4. draft extend (Drafter.extend) over the forward's rows, each with its next token, which proposes the next x_1;
  5. the committed tokens, their counts and logprobs queued to the host.
A step that fits the CUDA graphs (every item a verify of d drafts: spec/graphs.py) replays them: a greedy step all of
1-4 as one graph (spec/greedy_step.py; one copy back, the accepted tokens and counts), a sampled one steps 1, 2 and 4
with the same eager code between them; any other step runs all of it eager. A chained launch (the scheduler
reserved S steps of KV: ScheduledReq.chain_slots) replays S greedy steps as one graph and hands them back one step at
a time (spec/launch_steps.py); one that cannot run on the graphs runs its first step alone. Nothing in launch waits
on the device; collect waits once. The scheduler then keeps counts[b] tokens of request b
(fewer when a stop rule ends it), frees the KV of the rest and tells the capturer which rows were rejected
(spec.schedule.accept, RequestHooks.on_reject) before anything reads the forward's routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..forward_batch import ForwardBatch
from ..host_staging import HostStaging
from ..kv_pool import KVPool, ReqToTokenPool
from ..launch.step_layout import step_layout
from ..model import DeepseekForCausalLM
from ..model_config import ModelConfig
from ..model_runner import Launched, ModelRunner, listed_ids
from ..parallel import ParallelInfo
from ..penalties import penalty_rows
from ..replay import replay_plan
from ..sampling import Sampler
from ..step import ReqOutput, ScheduledReq
from .drafter import Drafter
from .graphs import SpecGraphs
from .launch_steps import StepsLaunched, step_results
from .outputs import split_outputs
from .penalised import record_accepted, verify_penalty
from .plan import StepPlan, plan_step
from .verify import accept_greedy, accept_sampled


class SpecRunner(ModelRunner):
    def __init__(
        self, model: DeepseekForCausalLM, drafter: Drafter, pool: KVPool, req_pool: ReqToTokenPool,
        sampler: Sampler, device: str, model_config: ModelConfig, parallel: ParallelInfo | None = None,
        graphs: SpecGraphs | None = None,
    ) -> None:
        """graphs: the draft and verify CUDA graphs (None: every step eager)."""
        super().__init__(model, pool, req_pool, sampler, device, model_config, None, parallel)
        self.target = model
        self.drafter = drafter
        self.spec_graphs = graphs
        # up to ~12 copies a step (each chain forward's batch, the target's, its drafts, acceptance, the extend's
        # next tokens, the input-logprob rows): a ring of 32 comes back only after the step's one wait
        self.staging = HostStaging(device, num_buffers=32)

    def launch(self, items: list[ScheduledReq]) -> Launched:
        """One step; a step mixing prefill chunks with greedy verifies that fit the greedy graph runs as two forwards:
        the chunks eager, the verifies on the graph (one eager forward of both was ~7 ms at batch 32 on the H200, the
        graph ~0.8 ms; in exact mode a row's bits do not depend on its batch, so the split changes none)."""
        verifies = [it for it in items if it.phase == "verify"]
        graphs = self.spec_graphs
        split = (graphs is not None and 0 < len(verifies) < len(items) and graphs.can_run(verifies, None)
                 and all(it.req.params.is_greedy for it in verifies) and all(it.req.replay is None for it in items))
        if not split:
            return self._launch(items)
        rest = [it for it in items if it.phase != "verify"]
        return _TwoForwards(items=items, parts=[self._launch(rest), self._launch(verifies)])

    def _launch(self, items: list[ScheduledReq]) -> Launched:
        stage = self.staging.to_device
        self.req_pool.flush(stage)
        plan = plan_step(items, self.drafter.steps)
        req_to_token = self.req_pool.req_to_token
        replay = replay_plan(items, len(plan.input_ids), self.model_config, self.device, stage)
        # the step's three forwards replay CUDA graphs when it fits them (spec/graphs.py), else all run eager
        graphs = self.spec_graphs if self.spec_graphs is not None and self.spec_graphs.can_run(items, replay) else None
        # the greedy graph's acceptance reads the raw logits: a step with penalties runs the verify graph and the
        # eager acceptance instead (penalised.py)
        greedy_graph = (graphs is not None and all(it.req.params.is_greedy for it in items)
                        and penalty_rows(items) is None)
        if not greedy_graph:  # the greedy graph drafts on the device
            verifies = [it for it in items if it.phase == "verify"]
            # a step with a prefill chunk runs its target forward and extend eager, but its verifies' chain drafts
            # are decode batches the chain graphs hold (an eager chain forward is ~1.5 ms at batch 32 on the H200)
            chain = graphs or (self.spec_graphs if self.spec_graphs is not None
                               and self.spec_graphs.can_chain(verifies) else None)
            self.drafter.chain(verifies, self.forward_id, req_to_token, self.device, stage, chain)
        fb = ForwardBatch.build(
            forward_id=self.forward_id, input_ids=plan.input_ids, prefix_lens=[it.start for it in items],
            extend_lens=[it.extend_len for it in items], req_pool_indices=[it.req.pool_row for it in items],
            out_cache_loc=np.concatenate([it.out_cache_loc for it in items]), req_to_token=req_to_token,
            logits_rows=plan.logits_rows, device=self.device, request_ids=[it.req.rid for it in items],
            phases=[it.phase for it in items], replay=replay, stage=stage,
        )
        step_layout(fb, self.parallel)
        self.forward_id += 1
        if greedy_graph:
            assert graphs is not None
            if graphs.launch_steps > 1 and all(it.chain_slots is not None and it.req.logprob is None for it in items):
                return self._launch_steps(items, fb, graphs)
            return self._launch_greedy(items, fb, graphs)
        if plan.draft_dst:
            idx = stage(np.array(plan.draft_dst + plan.draft_src, np.int64))
            n = len(plan.draft_dst)
            fb.input_ids.index_copy_(0, idx[:n], self.drafter.tokens.view(-1).index_select(0, idx[n:]))
        if graphs is None:
            logits, hidden = self.target.forward_hidden(fb, self.pool.kv_buffer)  # [N, V] fp32, [T, D]
        else:  # the routers' capture writes are in the graph; the recorder's hooks run around it, as eagerly
            self.target.recorder.on_forward_begin(fb)
            logits, hidden = graphs.verify_forward(fb)  # [T, V] fp32 (N = T: logits at every verify row), [T, D]
            self.target.recorder.on_forward_end(fb)

        on_device = self._input_logprobs(items, plan, logits)
        draft_ids = fb.input_ids.roll(-1)  # [T] row r's next token is row r + 1's input, within a request
        if plan.next_rows:
            fix = stage(np.array(plan.next_rows + plan.next_ids, np.int64))
            draft_ids.index_copy_(0, fix[: len(plan.next_rows)], fix[len(plan.next_rows) :])
        out_rows = req_rows = torch.zeros(0, dtype=torch.int64, device=self.device)
        if plan.samplers:
            b, d = len(plan.samplers), plan.depth
            packed = stage(np.array(plan.gather + plan.verify_row + plan.draft_lens
                                    + [it.req.pool_row for it in plan.samplers], np.int64))
            gather, verify_row, draft_lens, req_rows = packed.split([b * (d + 1), b, b, b])
            rows_logits = logits.index_select(0, gather).view(b, d + 1, -1)  # [B, d + 1, V]
            tokens, counts, rows_logits, penalised = self._accept(plan.samplers, rows_logits, draft_lens, req_rows, d)
            on_device["tokens"], on_device["counts"] = tokens, counts
            last = counts - 1
            out_rows = verify_row + last  # [B] the row of the last committed token's position - 1
            draft_ids.index_copy_(0, out_rows, tokens.gather(1, last[:, None])[:, 0])
            self._output_logprobs(plan.samplers, rows_logits, tokens, on_device, penalised)
        self.drafter.extend(fb, draft_ids, hidden, out_rows, req_rows, plan.samplers, graphs)

        return _queued(items, plan.lp_rows, on_device)

    def _launch_greedy(self, items: list[ScheduledReq], fb: ForwardBatch, graphs: SpecGraphs) -> Launched:
        """A greedy step on graphs: one replay (spec/greedy_step.py) and one copy to the host, [B, n + 1]."""
        self.target.recorder.on_forward_begin(fb)
        out, logits = graphs.greedy_step(fb)  # [B, n + 1] int64, [B * n, V] fp32
        self.target.recorder.on_forward_end(fb)
        b, n = len(items), graphs.tokens
        on_device: dict[str, torch.Tensor] = {}
        self._output_logprobs(items, logits.view(b, n, -1), out[:, :n], on_device)
        launched = _queued(items, [], {"out": out, **on_device})
        host = launched.host.pop("out")
        launched.host.update(tokens=host[:, :n], counts=host[:, n])  # views of the one copy
        return launched

    def _launch_steps(self, items: list[ScheduledReq], fb: ForwardBatch, graphs: SpecGraphs) -> Launched:
        """S greedy steps in one replay and one copy to the host, [S, B, n + 1]; forward ids f .. f + S - 1. The
        recorder's begin hook runs now (it orders the replay after the copy of the forward before), its end hook per
        step in `results`."""
        self.target.recorder.on_forward_begin(fb)
        out, bs = graphs.greedy_steps(fb)
        self.forward_id += graphs.launch_steps - 1
        queued = _queued(items, [], {"out": out})
        return StepsLaunched(items=items, host=queued.host, event=queued.event, fb=fb, graph_bs=bs)

    def results(self, launched: Launched) -> Iterator[tuple[list[ScheduledReq], list[ReqOutput]]]:
        if isinstance(launched, StepsLaunched):
            return step_results(launched, self.target.recorder)
        return super().results(launched)

    def _accept(
        self, samplers: list[ScheduledReq], logits: torch.Tensor, draft_lens: torch.Tensor, req_rows: torch.Tensor,
        d: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """logits: [B, d + 1, V] -> (tokens [B, d + 1], counts [B], the logits acceptance read [B, d + 1, V], whether
        penalties processed them), verify.py per request on the rows processed as penalised.py says."""
        b, v = logits.shape[0], logits.shape[2]
        drafts = self.drafter.tokens.index_select(0, req_rows)[:, :d]  # [B, d]
        penalty = verify_penalty(self.penalties, samplers, drafts, self.staging.to_device)
        if penalty is not None:
            logits = penalty.apply(logits.view(-1, v)).view(b, d + 1, v)
        tokens, counts = self._accept_rows(samplers, logits, drafts, draft_lens, req_rows, d)
        record_accepted(penalty, tokens, counts, req_rows)
        return tokens, counts, logits, penalty is not None

    def _accept_rows(
        self, samplers: list[ScheduledReq], logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor,
        req_rows: torch.Tensor, d: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        greedy = accept_greedy(logits.argmax(dim=-1), drafts, draft_lens)
        params = [it.req.params for it in samplers]
        if all(p.is_greedy for p in params):
            return greedy
        b, v = logits.shape[0], logits.shape[2]
        generators = [it.req.generator for it in samplers]
        p = self.sampler.probs(logits.view(-1, v), [x for x in params for _ in range(d + 1)]).view(b, d + 1, v)
        q = self.drafter.probs.index_select(0, req_rows)[:, :d]  # [B, d, V]
        u = self.sampler.noise((b, d), generators, "uniform")
        race = self.sampler.noise((b, v), generators, "exponential")
        sampled = accept_sampled(p, q, drafts, draft_lens, u, race)
        is_greedy = self.staging.to_device(np.array([x.is_greedy for x in params], np.bool_))  # [B]
        return (torch.where(is_greedy[:, None], greedy.tokens, sampled.tokens),
                torch.where(is_greedy, greedy.counts, sampled.counts))

    def _input_logprobs(self, items: list[ScheduledReq], plan: StepPlan,
                        logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Prompt logprobs of prefill rows that asked, as ModelRunner computes them."""
        out: dict[str, torch.Tensor] = {}
        if not plan.lp_rows:
            return out
        n = len(plan.lp_rows)
        packed = self.staging.to_device(np.asarray(plan.lp_rows + plan.lp_targets, dtype=np.int64))
        logprobs = torch.log_softmax(logits.index_select(0, packed[:n]), dim=-1)  # [n, V]
        out["in_lp"] = logprobs.gather(1, packed[n:, None])[:, 0]
        top_num = max((it.req.logprob.top_num for it in items if it.req.logprob is not None), default=0)
        if top_num:
            top = logprobs.topk(min(top_num, logprobs.shape[1]), dim=-1)
            out["in_top_v"], out["in_top_i"] = top.values, top.indices
        listed = listed_ids(items, [len(it.logprob_positions) for it in items], n)
        if listed is not None:  # token_ids_logprob: the listed ids' columns of each input-logprob row, [n, M]
            out["in_ids_lp"] = logprobs.gather(1, self.staging.to_device(listed).view(listed.shape))
        return out

    def _output_logprobs(self, samplers: list[ScheduledReq], logits: torch.Tensor, tokens: torch.Tensor,
                         out: dict[str, torch.Tensor], penalised: bool = False) -> None:
        """The logprob of each committed token at its row, and top lists: the log-softmax of the logits over the
        request's temperature (greedy: 1), as ModelRunner scores output rows (SGLang's default). penalised: the
        logits are already processed by the step's penalties, min_new_tokens and logit_bias (penalised.py)."""
        asked = [it.req.logprob for it in samplers if it.req.logprob is not None]
        if not asked:
            return
        b, n, v = logits.shape
        params = [it.req.params for it in samplers for _ in range(n)]
        scored = self.sampler.scored_logits(logits.reshape(b * n, v), params, penalised=penalised)
        logprobs = torch.log_softmax(logits if scored is None else scored.view(b, n, v), dim=-1)  # [B, d + 1, V]
        out["next_lp"] = logprobs.gather(2, tokens[:, :, None])[:, :, 0]
        top_num = max(lp.top_num for lp in asked)
        if top_num:
            top = logprobs.topk(min(top_num, logprobs.shape[2]), dim=-1)
            out["top_v"], out["top_i"] = top.values, top.indices
        listed = listed_ids(samplers, [1] * b, b)
        if listed is not None:  # token_ids_logprob: the listed ids' columns at every verify row, [B, d + 1, M]
            index = self.staging.to_device(listed).view(listed.shape)
            out["ids_lp"] = logprobs.gather(2, index[:, None, :].expand(b, n, -1))

    def collect(self, launched: Launched) -> list[ReqOutput]:
        if isinstance(launched, _TwoForwards):
            outs = {id(it): out for part in launched.parts for it, out in zip(part.items, self.collect(part),
                                                                              strict=True)}
            return [outs[id(it)] for it in launched.items]
        if launched.event is not None:
            launched.event.synchronize()
        host = {k: v.tolist() for k, v in launched.host.items()}
        return split_outputs(launched.items, host)


def _queued(items: list[ScheduledReq], lp_rows: list[int], on_device: dict[str, torch.Tensor]) -> Launched:
    """The step's results copied to the host without waiting, and the event collect waits on (CUDA only)."""
    launched = Launched(items=items, lp_rows=lp_rows)
    launched.host = {k: v.to("cpu", non_blocking=True) for k, v in on_device.items()}
    if any(v.is_cuda for v in on_device.values()):
        launched.event = torch.cuda.Event()
        launched.event.record()
    return launched


@dataclass
class _TwoForwards(Launched):
    """A step launched as two forwards (SpecRunner.launch): items in the scheduler's order, each part's its own."""

    parts: list[Launched] = field(default_factory=list)
