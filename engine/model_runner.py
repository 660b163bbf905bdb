"""ModelRunner: turns a scheduled step into a ForwardBatch, runs the model, samples, scores logprobs.

Logits are computed only for the rows that need them: the last row of each request that samples,
plus prompt rows whose input logprobs were asked. N = len(logits_rows), V vocabulary. Every result
is copied to the host in one batch at the end: one device sync per step.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from r3trace.capture.recorder import RouteRecorder
from r3trace.engine.config import ModelConfig
from r3trace.engine.cuda_graph import DecodeGraphs
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.kv_pool import KVPool, ReqToTokenPool
from r3trace.engine.request import LogprobEntry
from r3trace.engine.route_capture import replay_plan
from r3trace.engine.sampling import Sampler
from r3trace.engine.step import ReqOutput, ScheduledReq


class CausalLM(Protocol):
    recorder: RouteRecorder

    def forward(self, fb: ForwardBatch, kv_buffer: torch.Tensor) -> torch.Tensor: ...


class ModelRunner:
    def __init__(
        self, model: CausalLM, pool: KVPool, req_pool: ReqToTokenPool, sampler: Sampler, device: str,
        model_config: ModelConfig, graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model_config = model_config
        self.graphs = graphs  # CUDA-graph decode, when the engine captured graphs
        self.model = model
        self.pool = pool
        self.req_pool = req_pool
        self.sampler = sampler
        self.device = device
        self.forward_id = 0

    def run(self, items: list[ScheduledReq]) -> list[ReqOutput]:
        input_ids: list[int] = []
        logits_rows: list[int] = []
        lp_rows: list[int] = []  # indices into logits for input-logprob rows
        lp_targets: list[int] = []  # the prompt token each of those rows scores
        sample_rows: list[int] = []  # indices into logits for the sampling rows
        for it in items:
            base = len(input_ids)
            fill = it.req.fill_ids
            input_ids.extend(fill[it.start : it.end])
            for p in it.logprob_positions:
                lp_rows.append(len(logits_rows))
                lp_targets.append(fill[p + 1])
                logits_rows.append(base + p - it.start)
            if it.sample:
                sample_rows.append(len(logits_rows))
                logits_rows.append(base + it.extend_len - 1)
        self.req_pool.flush()  # the scheduler's req_to_token writes, one copy, before anything reads them
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
            replay=replay_plan(items, len(input_ids), self.model_config, self.device),
        )
        self.forward_id += 1
        if self.graphs is not None and self.graphs.can_run(fb):
            recorder = self.model.recorder
            recorder.on_forward_begin(fb)
            logits = self.graphs.run(fb)  # [B, V] float32; the capturer's slice writes are in the graph
            recorder.on_forward_end(fb)
        else:
            logits = self.model.forward(fb, self.pool.kv_buffer)  # [N, V] float32
        return self._outputs(items, logits, lp_rows, lp_targets, sample_rows)

    def _outputs(
        self,
        items: list[ScheduledReq],
        logits: torch.Tensor,
        lp_rows: list[int],
        lp_targets: list[int],
        sample_rows: list[int],
    ) -> list[ReqOutput]:
        samplers = [it for it in items if it.sample]
        dev = logits.device
        on_device: dict[str, torch.Tensor] = {}
        next_ids = None
        # Decode: every logits row samples; indexing by a host list would cost a copy and a gather kernel.
        every_row = len(sample_rows) == logits.shape[0] and sample_rows == list(range(len(sample_rows)))
        if sample_rows:
            next_ids = self.sampler.sample(
                logits if every_row else logits[sample_rows],
                [it.req.params for it in samplers], [it.req.generator for it in samplers],
            )  # [B]
            on_device["next"] = next_ids
        want_lp = any(it.req.logprob is not None for it in items)
        top_num = max((it.req.logprob.top_num for it in items if it.req.logprob is not None), default=0)
        if want_lp and logits.shape[0]:
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
            if lp_rows:
                rows = torch.tensor(lp_rows, device=dev)
                targets = torch.tensor(lp_targets, device=dev)[:, None]
                on_device["in_lp"] = logprobs[rows].gather(1, targets)[:, 0]
            if next_ids is not None:
                sampled_lp = logprobs if every_row else logprobs[sample_rows]  # [B, V]
                on_device["next_lp"] = sampled_lp.gather(1, next_ids[:, None])[:, 0]
            if top_num:
                top = logprobs.topk(min(top_num, logprobs.shape[1]), dim=-1)  # [N, top]
                on_device["top_v"], on_device["top_i"] = top.values, top.indices
        host = _to_host(on_device)
        return _split(items, host, lp_rows, sample_rows)


def _to_host(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """The step's one device->host sync: every copy queued, then one wait."""
    staged = {k: v.to("cpu", non_blocking=True) for k, v in tensors.items()}
    if any(v.is_cuda for v in tensors.values()):
        torch.cuda.current_stream().synchronize()
    return {k: v.tolist() for k, v in staged.items()}


def _split(
    items: list[ScheduledReq], host: dict[str, list], lp_rows: list[int], sample_rows: list[int]
) -> list[ReqOutput]:
    """Hand each request its rows of the step's results."""

    def tops(row: int, k: int) -> list[LogprobEntry]:
        return [(v, i, None) for v, i in zip(host["top_v"][row][:k], host["top_i"][row][:k], strict=True)]

    outs: list[ReqOutput] = []
    lp_pos = sample_pos = 0
    for it in items:
        out = ReqOutput()
        k = it.req.logprob.top_num if it.req.logprob is not None else 0
        n_lp = len(it.logprob_positions)
        if n_lp:
            out.input_logprobs = host["in_lp"][lp_pos : lp_pos + n_lp]
            if k:
                out.input_tops = [tops(lp_rows[j], k) for j in range(lp_pos, lp_pos + n_lp)]
            lp_pos += n_lp
        if it.sample:
            out.next_token = int(host["next"][sample_pos])
            if it.req.logprob is not None:
                out.next_logprob = host["next_lp"][sample_pos]
                if k:
                    out.next_top = tops(sample_rows[sample_pos], k)
            sample_pos += 1
        outs.append(out)
    return outs
