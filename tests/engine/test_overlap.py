"""The overlapped scheduler (EngineConfig.overlap_schedule) against the serial one on a tiny random DeepSeek-V3.

Overlap schedules step i+1 before step i's tokens reach the host, so a request that stops on a sampled token
(a stop token here, EOS in serving) already holds a position in the step ahead. These tests stop requests at
different steps and check that everything a caller or a later request can see is what the serial loop gives:
tokens, finish reasons, logprobs, routes (returned, streamed and recorded by the trace sink), prefix-cache hits
and the KV pool afterwards. num_dropped_ahead > 0 proves the rollback ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
import torch

import r3trace
from tests.engine.conftest import EngineFactory, assert_pool_whole, greedy, random_prompts

PROMPTS = random_prompts(6, 5, 19, seed=31)
NEW = 14


def _stops(make_engine: EngineFactory, **opts: Any) -> list[dict[str, Any]]:
    """Per request, a stop token it first samples at a different step (2, 4, ..., 12), from a free run."""
    free = make_engine(overlap_schedule=False, **opts).generate(input_ids=PROMPTS, sampling_params=greedy(NEW))
    params = []
    for i, out in enumerate(free):
        ids = out["output_ids"]
        step = next(k for k in range(2 + 2 * i, NEW) if ids[k] not in ids[:k])  # its first occurrence
        params.append(greedy(NEW, stop_token_ids=[ids[step]], ignore_eos=False))
    return params


def _run(make_engine: EngineFactory, overlap: bool, params: list[dict[str, Any]], **opts: Any) -> Any:
    engine = make_engine(overlap_schedule=overlap, **opts)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_routed_experts=True,
                           return_logprob=True)
    return engine, outs


def test_stops_mid_batch_match_the_serial_loop(make_engine: EngineFactory) -> None:
    params = _stops(make_engine)
    for opts in ({}, {"page_size": 4}, {"page_size": 3, "kv_pool_tokens": 3000, "enable_prefix_cache": False}):
        serial, want = _run(make_engine, False, params, **opts)
        engine, got = _run(make_engine, True, params, **opts)
        assert engine.scheduler.num_dropped_ahead > 0 and serial.scheduler.num_dropped_ahead == 0
        lengths = {len(o["output_ids"]) for o in got}
        assert len(lengths) > 3  # the requests really stopped at different steps
        for a, b in zip(want, got, strict=True):
            assert a["output_ids"] == b["output_ids"]
            assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
            assert b["meta_info"]["finish_reason"]["type"] == "stop"
            ra, rb = (r3trace.decode_routed_experts(x["meta_info"]) for x in (a, b))
            assert rb.shape[0] == len(b["output_ids"]) + b["meta_info"]["prompt_tokens"] - 1  # no ahead row
            np.testing.assert_array_equal(ra, rb)
            # fp32 on the CPU: the step ahead adds rows to a batch, which may change a GEMM's blocking (1e-6)
            np.testing.assert_allclose([x[0] for x in a["meta_info"]["output_token_logprobs"]],
                                       [x[0] for x in b["meta_info"]["output_token_logprobs"]], atol=1e-5)
        assert_pool_whole(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_on_the_gpu_matches_the_serial_loop(make_engine: EngineFactory) -> None:
    """The real asynchrony: CUDA graphs, pinned staging, the step ahead's inputs gathered on the device."""
    gpu = dict(attention_backend="triton", moe_backend="triton", topk_backend="triton", norm_backend="triton",
               rope_backend="triton", device="cuda", cuda_graph_batch_sizes=(1, 2, 4, 8), max_running_requests=8)
    params = _stops(make_engine, **gpu)
    serial, want = _run(make_engine, False, params, **gpu)
    engine, got = _run(make_engine, True, params, **gpu)
    assert engine.scheduler.num_dropped_ahead > 0
    for a, b in zip(want, got, strict=True):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_array_equal(r3trace.decode_routed_experts(a["meta_info"]),
                                      r3trace.decode_routed_experts(b["meta_info"]))
    assert_pool_whole(engine)


def test_prefix_cache_never_holds_a_position_computed_ahead(make_engine: EngineFactory) -> None:
    """Round 2 extends each round-1 sequence: the cache hits (cached_tokens) and tokens match the serial loop."""
    params = _stops(make_engine)
    results = {}
    for overlap in (False, True):
        engine, first = _run(make_engine, overlap, params, page_size=2)
        again = [p + o["output_ids"] + [7, 8] for p, o in zip(PROMPTS, first, strict=True)]
        second = engine.generate(input_ids=again, sampling_params=greedy(4), return_routed_experts=True)
        results[overlap] = [(o["output_ids"], o["meta_info"]["cached_tokens"],
                             r3trace.decode_routed_experts(o["meta_info"]).tolist()) for o in second]
        assert_pool_whole(engine)
    assert results[True] == results[False]
    assert all(cached > 0 for _, cached, _ in results[True])


def test_streamed_routes_and_the_trace_sink_see_only_computed_rows(make_engine: EngineFactory, tmp_path: Path) -> None:
    params = _stops(make_engine)
    traces = {}
    for overlap in (False, True):
        engine = make_engine(overlap_schedule=overlap)
        trace = tmp_path / f"trace-{overlap}"
        engine.start_trace(trace, run_id="r")
        streamed: dict[int, list[np.ndarray]] = {}
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            for chunk in engine.generate(input_ids=prompt, sampling_params=p, return_routed_experts=True,
                                         stream=True, rid=f"s{i}"):
                if "routed_experts" in chunk["meta_info"]:
                    streamed.setdefault(i, []).append(r3trace.decode_routed_experts(chunk["meta_info"]))
        engine.generate(input_ids=PROMPTS, sampling_params=params, rid=[f"b{i}" for i in range(len(PROMPTS))])
        engine.stop_trace()
        con = duckdb.connect()
        rows = con.execute(
            f"SELECT request_id, token_pos, layer_id, topk_ids FROM read_parquet('{trace}/**/part-*.parquet') "
            "ORDER BY request_id, token_pos, layer_id"
        ).fetchall()
        traces[overlap] = (rows, {i: np.concatenate(v).tolist() for i, v in streamed.items()})
        if overlap:
            assert engine.scheduler.num_dropped_ahead > 0
    assert traces[True] == traces[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_ahead_launches_without_blocking_the_host(make_engine: EngineFactory,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch of a step scheduled ahead runs under torch's sync debug mode "error": any blocking copy or
    device sync (a torch.tensor(..., device=) of sampling parameters, an .item()) raises. Sampling with
    temperature, top-k, top-p and seeds (the RL rollout case) exercises the sampler's staged copies."""
    from r3trace.engine.model_runner import ModelRunner

    launch = ModelRunner.launch
    checked = []

    def strict_launch(self: ModelRunner, items: list[Any]) -> Any:
        if not items or not all(it.ahead for it in items):
            return launch(self, items)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(self, items)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(len(items))

    monkeypatch.setattr(ModelRunner, "launch", strict_launch)
    engine = make_engine(attention_backend="triton", moe_backend="triton", topk_backend="triton",
                         norm_backend="triton", rope_backend="triton", device="cuda",
                         cuda_graph_batch_sizes=(1, 2, 4, 8), max_running_requests=8)
    params = [{"temperature": 0.8, "top_k": 20, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True,
               **({"seed": i} if i % 2 else {})} for i in range(len(PROMPTS))]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert all(len(o["output_ids"]) == 12 for o in outs)
    assert len(checked) >= 8  # most of the 11 decode steps were scheduled ahead and checked


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_input_logprobs_on_the_gpu_match_the_cpu(make_engine: EngineFactory) -> None:
    """Input-logprob rows reach the device through the runner's pinned staging (one packed copy of rows and
    targets): the prompt tokens' logprobs on CUDA equal the CPU engine's (fp32, 1e-4: a GEMM's blocking)."""
    params = greedy(3)
    kw = dict(return_logprob=True, logprob_start_len=0)
    cpu = make_engine().generate(input_ids=PROMPTS, sampling_params=params, **kw)
    gpu = make_engine(device="cuda", attention_backend="triton", moe_backend="triton", topk_backend="triton",
                      cuda_graph_batch_sizes=()).generate(input_ids=PROMPTS, sampling_params=params, **kw)
    for a, b in zip(cpu, gpu, strict=True):
        la = [x[0] for x in a["meta_info"]["input_token_logprobs"] if x[0] is not None]
        lb = [x[0] for x in b["meta_info"]["input_token_logprobs"] if x[0] is not None]
        assert len(la) == len(lb) > 3
        np.testing.assert_allclose(la, lb, atol=1e-4)
