"""Exact mode under DP attention and expert parallelism, bitwise against one process, through Engine.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_parallel_exact.py  (-m slow: ep2 and the tp4 ones)

One workload (bench/multigpu/workload.py, which bench/multigpu runs on GPUs over NCCL) runs on a one-process
`Engine(deterministic=True)` and on each layout (dp2, ep2, dp2+ep2: world size 2; tp4 dp2 and tp4 dp2 ep2,
attention TP 2: world size 4, slow), one Engine per layout, a trace recording throughout. Its cases (spread,
idle_rank, prefix, idle_middle + stream, replay, preempt) are the ones of issue 22's matrix that a layout can get
wrong; the workload's docstring lists them. The stream's chunks joined equal the one-process non-stream result.
Exact mode promises the same bits in any batch, chunking, cache state and layout, so every comparison is ==:
greedy tokens, input and output logprobs (top-2 too), routes (0 mismatched (token, layer) entries) and their
weights. fp32, samples/model. The trace holds one row set per (request, position, layer), stamped with the DP rank
the request ran on, equal to the routes returned.

A capturer that reads a DP rank's rows at [0, n) instead of its row range fails dp2 and tp4 dp2 (spread[1], the
first request on DP rank 1: 68 of 85 entries); under dp2+ep2 a rank's MoE rows do start at 0 (scattered tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.multigpu.compare import ExactDiff, exact_diff
from bench.multigpu.workload import ASK, LONG, OPTIONS, Results, greedy, routes_of, run_workload, trace_problems
from r3trace.engine import Engine

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "model"


@pytest.fixture(scope="module")
def reference() -> Results:
    with Engine(SAMPLE, **OPTIONS) as ref:
        res = run_workload(ref, dp_size=1, scheduler=ref.scheduler)
        whole = ref.generate(input_ids=LONG, sampling_params=greedy(40), **ASK)
    stream = ExactDiff()
    stream.add("stream against non-stream", whole, res["stream"][0])  # type: ignore[arg-type]
    assert stream.clean, stream.problems
    return res


LAYOUTS = [
    pytest.param(2, 2, 1, id="dp2"),
    pytest.param(2, 1, 2, id="ep2", marks=pytest.mark.slow),  # 28 s; dp2_ep2 runs the same dispatch and combine
    pytest.param(2, 2, 2, id="dp2_ep2"),
    pytest.param(4, 2, 1, id="tp4_dp2", marks=pytest.mark.slow),  # attention TP 2, the MoE tensor-parallel
    pytest.param(4, 2, 2, id="tp4_dp2_ep2", marks=pytest.mark.slow),  # attention TP 2: routes all-gathered
]


@pytest.mark.parametrize(("tp", "dp", "ep"), LAYOUTS)
def test_layout_is_bitwise_one_process(reference: Results, tmp_path: Path, tp: int, dp: int, ep: int) -> None:
    with Engine(SAMPLE, tp_size=tp, dp_size=dp, ep_size=ep, **OPTIONS) as engine:
        engine.start_trace(tmp_path / "trace", run_id="matrix")
        got = run_workload(engine, dp_size=dp)
        manifest = engine.stop_trace()
    assert manifest is not None and manifest["parallel"] == {"tp_size": tp, "dp_size": dp, "ep_size": ep}
    diff = exact_diff(reference, got)
    assert diff.clean and diff.route_mismatches == 0 and diff.route_entries > 0, diff.problems[:5]
    # the prefix-cache hit is on the request's own DP rank only
    assert [o["meta_info"]["cached_tokens"] for o in got["prefix"]] == [0, 40, 0 if dp > 1 else 40]
    # replay: the returned routes are the forced ones, and forcing R1's routes onto R0 changed its logprobs
    free, replay = got["replay_free"], got["replay"]
    np.testing.assert_array_equal(routes_of(replay[1]), routes_of(free[1]))
    np.testing.assert_array_equal(routes_of(replay[2]), routes_of(free[0]))
    assert replay[1]["meta_info"]["input_token_logprobs"][1:] != free[0]["meta_info"]["input_token_logprobs"][1:]
    assert trace_problems(str(tmp_path / "trace" / "routes" / "**" / "part-*.parquet"), got, dp) == []



def test_exact_mode_graphs_under_tp_are_refused_before_any_rank_starts() -> None:
    """CUDA graphs in exact mode with tp_size > 1 have not run on a GPU (exact_all_reduce's all_gather under capture):
    refused at construction in one line naming the fields; one process, or TP with graphs off, is accepted. The Engine
    refuses before it reads the checkpoint or touches CUDA, so this runs on the CPU suite."""
    from r3trace.engine.engine_config import EngineConfig, EngineConfigError

    cfg = EngineConfig(device="cuda", deterministic=True, cuda_graph_batch_sizes=(1, 2))
    cfg.check_graph_layout(1, 1, 1)  # one process: exact mode's graphs (tests/engine/test_exact_mode.py)
    EngineConfig(device="cuda", deterministic=True, cuda_graph_batch_sizes=()).check_graph_layout(2, 1, 1)
    EngineConfig(device="cuda", attention_backend="triton", moe_backend="triton", topk_backend="triton",
                 cuda_graph_batch_sizes=(1, 2)).check_graph_layout(2, 1, 1)  # plain TP: captured
    with pytest.raises(EngineConfigError) as err:
        cfg.check_graph_layout(2, 1, 1)
    assert str(err.value).startswith("cuda_graph_batch_sizes=(1, 2): not with deterministic=True and tp_size=2")
    assert "\n" not in str(err.value)
    with pytest.raises(EngineConfigError, match=r"not with dp_size=2, ep_size=1"):
        cfg.check_graph_layout(2, 2, 1)
    with pytest.raises(EngineConfigError, match=r"^cuda_graph_batch_sizes=\(1,\): not with deterministic=True and "
                                                r"tp_size=2"):
        Engine(SAMPLE, device="cuda", deterministic=True, cuda_graph_batch_sizes=(1,), tp_size=2)
