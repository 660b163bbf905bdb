"""ModelRunner: turns a scheduled step into a ForwardBatch, runs the model, samples, scores logprobs.

Logits are computed only for the rows that need them: the last row of each request that samples,
plus prompt rows whose input logprobs were asked. N = len(logits_rows), V vocabulary. Every result
is copied to the host in one batch at the end: one wait per step.

A step is launched, then collected. `launch` queues the forward, the sampling and the copies of the results to
the host, and returns without waiting; `collect` waits for those copies. Between the two the overlapped
scheduler launches the next step. Its decode inputs are this step's sampled tokens, which never cross to the
host first: every step whose requests all sample scatters its tokens into `next_tokens` by request row, and
a step scheduled ahead gathers its input ids from there on the device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from r3trace.capture.recorder import RouteRecorder
from r3trace.engine.cuda_graph import DecodeGraphs
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.host_staging import HostStaging
from r3trace.engine.kv_pool import KVPool, ReqToTokenPool
from r3trace.engine.launch.step_layout import idle_batch, step_layout
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.penalties import Penalties, penalty_rows
from r3trace.engine.replay import replay_plan
from r3trace.engine.sampling import Sampler
from r3trace.engine.step import ReqOutput, ScheduledReq, fill_input_logprobs, listed_entries, top_entries


class CausalLM(Protocol):
    recorder: RouteRecorder

    def forward(self, fb: ForwardBatch, kv_buffer: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Launched:
    """A step on its way: the host copies of its results land in `host` once `event` has passed."""

    items: list[ScheduledReq]
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    event: torch.cuda.Event | None = None
    lp_rows: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self, model: CausalLM, pool: KVPool, req_pool: ReqToTokenPool, sampler: Sampler, device: str,
        model_config: ModelConfig, graphs: DecodeGraphs | None = None, parallel: ParallelInfo | None = None,
    ) -> None:
        self.parallel = parallel or ParallelInfo()  # step_layout reads the DP rank and, under DP attention, groups
        self.model_config = model_config
        self.graphs = graphs  # CUDA-graph decode, when the engine captured graphs
        self.model = model
        self.pool = pool
        self.req_pool = req_pool
        self.sampler = sampler
        self.device = device
        self.forward_id = 0
        # up to 7 copies a step (host_staging.py's 5, token_ids_logprob's ids, the sampled rows whose output
        # logprobs are scored): 14 buffers come back two steps later
        self.staging = HostStaging(device, num_buffers=14)
        # [R] int64: the token each request row sampled last (read by steps scheduled ahead, see the docstring)
        self.next_tokens = torch.zeros(req_pool.req_to_token.shape[0], dtype=torch.int64, device=device)
        # the output counts of each request row, for SGLang's penalties (engine/penalties.py)
        self.penalties = Penalties(req_pool.req_to_token.shape[0], model_config.vocab_size,
                                   model_config.eos_token_ids, device)

    def run(self, items: list[ScheduledReq]) -> list[ReqOutput]:
        return self.collect(self.launch(items))

    def results(self, launched: Launched) -> Iterator[tuple[list[ScheduledReq], list[ReqOutput]]]:
        """What the scheduler processes of a launch, in order: its (items, outputs); a chained speculative launch
        yields one pair a step, each to be processed before the next is asked for (spec/launch_steps.py)."""
        yield launched.items, self.collect(launched)

    def launch(self, items: list[ScheduledReq]) -> Launched:
        """Queue the step's forward, sampling and result copies; no wait on the device."""
        ahead = sum(it.ahead for it in items)
        if ahead not in (0, len(items)):
            raise ValueError(f"a step has {ahead} of {len(items)} requests scheduled ahead: all or none")
        input_ids: list[int] = []
        logits_rows: list[int] = []
        lp_rows: list[int] = []  # indices into logits for input-logprob rows
        lp_targets: list[int] = []  # the prompt token each of those rows scores
        sample_rows: list[int] = []  # indices into logits for the sampling rows
        for it in items:
            base = len(input_ids)
            fill = it.req.fill_ids
            input_ids.extend(fill[it.start : it.end] if not it.ahead else [0])  # ahead: gathered on the device
            for p in it.logprob_positions:
                lp_rows.append(len(logits_rows))
                lp_targets.append(fill[p + 1])
                logits_rows.append(base + p - it.start)
            if it.sample:
                sample_rows.append(len(logits_rows))
                logits_rows.append(base + it.extend_len - 1)
        self.req_pool.flush(self.staging.to_device)  # the scheduler's req_to_token writes, before anything reads them
        fb = ForwardBatch.build(
            forward_id=self.forward_id,
            input_ids=input_ids,
            prefix_lens=[it.start for it in items],
            extend_lens=[it.extend_len for it in items],
            req_pool_indices=[it.req.pool_row for it in items],
            out_cache_loc=np.concatenate([it.out_cache_loc for it in items]),
            req_to_token=self.req_pool.req_to_token,
            logits_rows=logits_rows,
            device=self.device,
            request_ids=[it.req.rid for it in items],
            phases=[it.phase for it in items],
            replay=replay_plan(items, len(input_ids), self.model_config, self.device, self.staging.to_device),
            stage=self.staging.to_device,
        )
        step_layout(fb, self.parallel)  # dp_rank, and the DP layout under DP attention (a collective)
        if ahead:
            torch.index_select(self.next_tokens, 0, fb.req_pool_indices, out=fb.input_ids)
        self.forward_id += 1
        if self.graphs is not None and self.graphs.can_run(fb):
            recorder = self.model.recorder
            recorder.on_forward_begin(fb)
            logits = self.graphs.run(fb)  # [B, V] float32; the capturer's slice writes are in the graph
            recorder.on_forward_end(fb)
        else:
            logits = self.model.forward(fb, self.pool.kv_buffer)  # [N, V] float32
        on_device = self._results(items, fb, logits, lp_rows, lp_targets, sample_rows)
        launched = Launched(items=items, lp_rows=lp_rows, sample_rows=sample_rows)
        launched.host = {k: v.to("cpu", non_blocking=True) for k, v in on_device.items()}  # pinned, queued
        if any(v.is_cuda for v in on_device.values()):
            launched.event = torch.cuda.Event()
            launched.event.record()
        return launched

    def run_idle(self) -> None:
        """A DP rank with no requests while another has some: a forward of no tokens that joins every
        collective of the step (its layout's all-gather, the MoE's, the communicators')."""
        idle = idle_batch(self.forward_id, self.req_pool.req_to_token, self.device, self.parallel)
        fb = step_layout(idle, self.parallel)
        self.forward_id += 1  # forward ids stay equal on every rank: the trace's forward_id column agrees
        self.model.forward(fb, self.pool.kv_buffer)

    def collect(self, launched: Launched) -> list[ReqOutput]:
        """Wait for a launched step's results (the step's one wait) and hand each request its rows."""
        if launched.event is not None:
            launched.event.synchronize()
        host = {k: v.tolist() for k, v in launched.host.items()}
        return _split(launched.items, host, launched.lp_rows, launched.sample_rows)

    def _results(
        self,
        items: list[ScheduledReq],
        fb: ForwardBatch,
        logits: torch.Tensor,
        lp_rows: list[int],
        lp_targets: list[int],
        sample_rows: list[int],
    ) -> dict[str, torch.Tensor]:
        """Sampled tokens and logprobs of the step, on the device."""
        samplers = [it for it in items if it.sample]
        on_device: dict[str, torch.Tensor] = {}
        next_ids = None
        # Decode: every logits row samples; indexing by a host list would cost a copy and a gather kernel.
        every_row = len(sample_rows) == logits.shape[0] and sample_rows == list(range(len(sample_rows)))
        want_lp = any(it.req.logprob is not None for it in items)
        scored = None
        if sample_rows:
            rows = penalty_rows(samplers)
            sampled = self.sampler.sample_scored(
                logits if every_row else logits[sample_rows],
                [it.req.params for it in samplers], [it.req.generator for it in samplers],
                None if rows is None else self.penalties.step(rows, self.sampler.staging.to_device),
                scored=want_lp and any(it.req.logprob is not None for it in samplers),
            )
            next_ids, scored = sampled.ids, sampled.scored  # [B], [B, V] or None
            on_device["next"] = next_ids
            if len(samplers) == len(items):  # every request samples: the rows a step ahead reads
                self.next_tokens.index_copy_(0, fb.req_pool_indices, next_ids)
        top_num = max((it.req.logprob.top_num for it in items if it.req.logprob is not None), default=0)
        if want_lp and logits.shape[0]:
            # prompt rows score the raw logits; sampled rows the logits they were sampled from (SGLang's default:
            # after penalties and logit_bias, over the temperature; engine/sampling.py)
            if scored is not None and every_row:
                logprobs = torch.log_softmax(scored, dim=-1)  # [N, V]
            else:
                logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
                if scored is not None:
                    at = self.staging.to_device(np.asarray(sample_rows, dtype=np.int64))
                    logprobs = logprobs.index_copy(0, at, torch.log_softmax(scored, dim=-1))
            if lp_rows:  # the input-logprob rows and the prompt tokens they score: one staged copy, no blocking one
                n = len(lp_rows)
                packed = self.staging.to_device(np.asarray(lp_rows + lp_targets, dtype=np.int64))
                on_device["in_lp"] = logprobs[packed[:n]].gather(1, packed[n:, None])[:, 0]
            if next_ids is not None:
                sampled_lp = logprobs if every_row else logprobs[sample_rows]  # [B, V]
                on_device["next_lp"] = sampled_lp.gather(1, next_ids[:, None])[:, 0]
            if top_num:
                top = logprobs.topk(min(top_num, logprobs.shape[1]), dim=-1)  # [N, top]
                on_device["top_v"], on_device["top_i"] = top.values, top.indices
            listed = self._listed_ids(items, logits.shape[0])
            if listed is not None:  # token_ids_logprob: the listed ids' columns of every row, one gather
                index = self.staging.to_device(listed).view(listed.shape)  # staged: no blocking copy
                on_device["ids_lp"] = logprobs.gather(1, index)  # [N, M]
        return on_device

    @staticmethod
    def _listed_ids(items: list[ScheduledReq], n_rows: int) -> np.ndarray | None:
        """[N, M] int64: each logits row's request's token_ids_logprob ids (M the longest list, zero-padded), in the
        row order of `launch`; None when no request lists ids (the common case: no gather, no copy)."""
        return listed_ids(items, [len(it.logprob_positions) + int(it.sample) for it in items], n_rows)


def listed_ids(items: Sequence[ScheduledReq], rows: Sequence[int], n_rows: int) -> np.ndarray | None:
    """[n_rows, M] int64: rows[i] consecutive rows of item i's token_ids_logprob ids (M the longest list,
    zero-padded); None when no item's request lists ids."""
    lists = [it.req.logprob.token_ids if it.req.logprob is not None else () for it in items]
    width = max((len(ids) for ids in lists), default=0)
    if not width:
        return None
    out = np.zeros((n_rows, width), dtype=np.int64)
    row = 0
    for n, ids in zip(rows, lists, strict=True):
        out[row : row + n, : len(ids)] = ids
        row += n
    return out


def _split(
    items: list[ScheduledReq], host: dict[str, list], lp_rows: list[int], sample_rows: list[int]
) -> list[ReqOutput]:
    """Hand each request its rows of the step's results."""
    outs: list[ReqOutput] = []
    lp_pos = sample_pos = 0
    for it in items:
        out = ReqOutput()
        lp_pos += fill_input_logprobs(out, it, host.get("in_lp", []), lp_pos,
                                      lambda j: (host["top_v"][lp_rows[j]], host["top_i"][lp_rows[j]]),
                                      lambda j: host["ids_lp"][lp_rows[j]])
        if it.sample:
            out.next_token = int(host["next"][sample_pos])
            lp = it.req.logprob
            if lp is not None:
                row = sample_rows[sample_pos]
                out.next_logprob = host["next_lp"][sample_pos]
                if lp.top_num:
                    out.next_top = top_entries(host["top_v"][row], host["top_i"][row], lp.top_num)
                if lp.token_ids:
                    out.next_ids_lp = listed_entries(host["ids_lp"][row], lp.token_ids)
            sample_pos += 1
        outs.append(out)
    return outs
