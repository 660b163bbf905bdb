"""bench/multigpu: the result tables, the case plan, NVLink multicast off in every process, and the --smoke run.

Run: .venv/bin/pytest -q tests/bench/test_multigpu.py   (-m slow: the smoke, a few minutes on 2 cores)

The smoke runs `python -m bench.multigpu --smoke`: the whole matrix of a world of 2 on the CPU (gloo ranks,
samples/model, fp32) against one process, and the throughput part on the tiny random shape; every case must pass
with 0 mismatches, every rank must have started with the multicast settings, and every case of 4 or 8 GPUs must say
that it needs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.multigpu.cases import WORLDS, Layout, matrix
from bench.multigpu.compare import default_diff, exact_diff
from bench.multigpu.env import MULTICAST_OFF
from bench.multigpu.report import NOT_COMPARABLE, features, markdown
from bench.multigpu.throughput import ratios
from bench.multigpu.workload import PROMPTS
from r3trace.engine.near_tie import FlipCount

ROOT = Path(__file__).resolve().parents[2]


def _perf_row(layout: str, gpus: int, graphs: bool, prefill: float, decode: float, **extra: Any) -> dict[str, Any]:
    """A throughput row whose figures are per GPU: prefill at 4k tokens, decode at batch 32."""
    return {"layout": layout, "gpus": gpus, "graphs": graphs,
            "prefill": [{"tokens_per_rank": 4096, "tokens_per_s_per_gpu": prefill}],
            "decode": [{"batch_per_rank": 32, "tokens_per_s_per_gpu": decode, **extra}]}  # fmt: skip


def _result() -> dict[str, Any]:
    rows = [_perf_row("1gpu", 1, True, 40000.0, 20000.0, routes_overhead=0.004),
            _perf_row("1gpu", 1, False, 40000.0, 8000.0),
            _perf_row("dp2", 2, False, 36000.0, 6000.0, routes_overhead=0.0125, trace_overhead=-0.002),
            {"layout": "dp2_ep2", "gpus": 2, "status": "not run: time budget"}]  # fmt: skip
    ratios(rows)
    cases = [
        {"case": "exact/dp2", "gpus": 2, "status": "pass", "requests": 22, "token_mismatches": 0,
         "route_mismatches": 0, "route_entries": 4480, "trace_problems": 0, "problems": []},
        {"case": "default/tp2", "gpus": 2, "status": "fail", "requests": 22, "token_mismatches": 1,
         "route_mismatches": 3, "route_entries": 4000, "near_ties": 12, "near_tie_flips": 2, "trace_problems": 0,
         "problems": ["spread[1]: output ids differ"]},
        {"case": "exact/tp4", "gpus": 4, "mode": "exact", "status": "needs 4 GPUs"},
    ]  # fmt: skip
    return {"kind": "nvidia-h200-x2", "backend": "nccl",
            "matrix": {"model": "samples/model", "dtype": "float32", "near_tie": 1e-5, "cases": cases,
                       "references": [{"reference": "exact/1gpu", "status": "pass", "requests": 23}]},
            "throughput": {"config": {"prompt": 1024, "decode_prompt": 128, "new_tokens": 32, "dtype": "bfloat16",
                                      "backend": "triton", "prefill_tokens": [4096], "batches": [32]},
                           "shapes": {"v3-2.5b": {"summary": "D 2048", "rows": rows}}},
            "features": features(frozenset({"dtype"}), "speculative_algorithm='NEXTN': one process only")}  # fmt: skip


def test_tables_hold_each_figure_its_ratios_and_the_anchors() -> None:
    lines = markdown(_result()).splitlines()
    assert "| exact/1gpu (reference) | 1 | pass | 23 | - | - | - | - |  |" in lines
    assert "| exact/dp2 | 2 | pass | 22 | 0 | 0 / 4,480 | - | 0 |  |" in lines
    assert "| default/tp2 | 2 | fail | 22 | 1 | 3 / 4,000 | 12 (2) | 0 | spread[1]: output ids differ |" in lines
    assert "| exact/tp4 | 4 | needs 4 GPUs | - | - | - | - | - |  |" in lines
    # per GPU, then the ratio to one GPU eager / with graphs: 36000 / 40000, 6000 / 8000 and 6000 / 20000
    assert "| dp2 | 2 | no | 36,000 (0.90x / 0.90x) | 6,000 (0.75x / 0.30x) |" in lines
    assert "| 1gpu | 1 | yes | 40,000 | 20,000 |" in lines
    assert "| dp2_ep2 | 2 | - | not run: time budget | |" in lines
    capture = [line for line in lines if line.startswith("| v3-2.5b |")]
    assert capture[0].startswith("| v3-2.5b | 1gpu | 32 | +0.40% | - | synchronous capture ~13%")
    assert capture[1].startswith("| v3-2.5b | dp2 | 32 | +1.25% | -0.20% |")
    assert f"| routes returned | trace recording | SGLang ({NOT_COMPARABLE}) |" in "\n".join(lines)
    status = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in lines if "overlap" in line or "MTP" in line}
    assert status["two-batch overlap (TBO)"] == status["single-batch overlap (SBO)"] == "not landed"
    assert status["MTP speculative decoding, batch 1 and 32 under DP attention"].endswith("one process only")


def test_a_landed_option_is_not_reported_as_not_landed() -> None:
    rows = features(frozenset({"enable_two_batch_overlap"}), None)
    assert rows[0]["status"] == "landed: not measured by this script yet" and rows[1]["status"] == "not landed"
    assert rows[2]["status"] == "accepted under DP attention: not measured by this script yet"


def test_the_plan_holds_every_layout_and_refuses_with_a_reason() -> None:
    names = [c.name for c in matrix(WORLDS)]
    assert len(names) == len(set(names)) == 34
    for g in WORLDS:
        for case in (f"exact/tp{g}", f"exact/dp{g}", f"exact/ep{g}", f"exact/dp{g}_ep{g}", f"default/dp{g}_ep{g}",
                     f"exact/ep{g}+static+rebalance", f"exact/dp{g}_ep{g}+dynamic"):
            assert case in names
    by_name = {c.name: c for c in matrix(WORLDS)}
    assert by_name["exact/dp4"].refusal(2, 4) == "needs 4 GPUs"
    assert by_name["exact/tp8"].refusal(8, 4) == ("the model has 4 attention heads: attention TP 8 needs a "
                                                  "multiple of 8")  # fmt: skip
    assert by_name["exact/tp8_dp4_ep8"].refusal(8, 4) is None  # attention TP 2
    assert Layout(8, 4, 8).name == "tp8_dp4_ep8" and Layout(2, 1, 2).name == "ep2" and Layout(4, 2).name == "tp4_dp2"
    assert by_name["exact/ep2+static+rebalance"].engine_options()["ep_num_redundant_experts"] == 8


def test_multicast_is_off_before_torch_loads_and_in_spawned_processes() -> None:
    """The command's module sets the three variables when it is imported, before torch, and a process started the
    way the engine starts its ranks (torch.multiprocessing, spawn) has them in the environment it started with."""
    code = """
import json, time
import bench.multigpu.__main__ as cmd
import torch.multiprocessing as mp
from bench.multigpu.env import process_environment
child = mp.get_context("spawn").Process(target=time.sleep, args=(30,), daemon=True)
child.start()
cmdline = f"/proc/{child.pid}/cmdline"
while b"spawn_main" not in open(cmdline, "rb").read():  # forked, not yet exec'd: still the parent's first environment
    time.sleep(0.01)
env = process_environment(child.pid)
child.terminate()
print(json.dumps({"cmd": cmd.ENVIRONMENT, "child": {k: env.get(k) for k in cmd.ENVIRONMENT["set"]}}))
"""
    env = {k: v for k, v in os.environ.items() if k not in MULTICAST_OFF} | {"PYTHONPATH": str(ROOT)}
    env["NCCL_NVLS_ENABLE"] = "1"  # a setting already there is overridden
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["cmd"] == {"set": MULTICAST_OFF, "torch_imported_before": False}
    assert got["child"] == MULTICAST_OFF


@pytest.mark.slow
@pytest.mark.timeout(3300)  # the suite's 600 s is for one test; this is ten engines of two ranks: 7-14 min on 2 cores
def test_smoke_runs_the_whole_world_2_matrix_exactly(tmp_path: Path) -> None:
    out = tmp_path / "multigpu-smoke.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "bench.multigpu", "--smoke", "--budget-s", "3000", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    cases = {c["case"]: c for c in result["matrix"]["cases"]}
    assert sorted(cases) == sorted(c.name for c in matrix(WORLDS))  # nothing dropped
    for c in matrix(WORLDS):
        rec = cases[c.name]
        if c.gpus > 2:
            assert rec["status"] == f"needs {c.gpus} GPUs"
            continue
        assert rec["status"] == "pass", rec
        assert rec["token_mismatches"] == 0 and rec["route_mismatches"] == 0 and rec["route_entries"] > 0
        assert rec["multicast_env_missing"] == [] and rec["trace_problems"] == 0
        if c.mode == "exact":
            assert rec["logprob_mismatches"] == rec["weight_mismatches"] == 0
    assert cases["exact/ep2+static+rebalance"]["rebalance_run"]["chunks_after_update"] > 0
    rows = {r["layout"]: r for r in result["throughput"]["shapes"]["tiny"]["rows"]}
    assert rows["dp2_ep2"]["decode"][0]["vs_1gpu_eager"] > 0 and rows["dp2"]["prefill"][0]["tokens_per_s"] > 0
    assert rows["dp2"]["multicast_env_missing"] == []
    assert "### Parallel matrix: cpu-smoke" in done.stdout


def _out(tokens: list[int], routes: np.ndarray, logprob: float = -1.0) -> dict[str, Any]:
    """A result in the joined-stream form (routes decoded): 4 rows, L = 2 (layer 0 dense), K = 2."""
    lp = [[logprob, t] for t in tokens]
    meta = {"input_token_logprobs": [[None, 5]] + lp[:1], "output_token_logprobs": lp, "input_top_logprobs": [],
            "output_top_logprobs": []}  # fmt: skip
    return {"output_ids": tokens, "meta_info": meta, "routes": routes, "weights": np.ones(routes.shape)}


def _routes() -> np.ndarray:
    r = np.full((4, 2, 2), -1)
    r[:, 1] = [[3, 1], [0, 2], [1, 2], [3, 0]]
    return r


def test_exact_diff_counts_every_kind_of_difference() -> None:
    want = {"spread": [_out([7, 8], _routes()), _out([9, 9], _routes())]}
    same = exact_diff(want, {"spread": [_out([7, 8], _routes()), _out([9, 9], _routes())]})
    assert same.clean and same.route_entries == 8 and same.route_mismatches == 0
    swapped = _routes()
    swapped[2, 1] = [2, 1]  # the same set, another order: a mismatch
    got = {"spread": [_out([7, 8], swapped), _out([9, 4], _routes(), logprob=-1.5)]}
    diff = exact_diff(want, got)
    assert (diff.requests, diff.token_mismatches, diff.route_mismatches) == (2, 1, 1)
    assert diff.logprob_mismatches == 3  # the second request's input logprob and both output logprobs
    assert not exact_diff(want, {"spread": got["spread"][:1]}).clean  # a missing result


def test_default_diff_excludes_near_ties_and_counts_the_rest() -> None:
    gaps = np.full((4, 2), 0.3)
    gaps[2, 1] = 1e-6  # row 2 of the MoE layer is a near-tie

    def gap_fn(seq: list[int]) -> np.ndarray:
        assert seq == (PROMPTS["spread"][0] + [7, 8])[:4]  # the request's own tokens, as many as its route rows
        return gaps

    want = {"spread": [_out([7, 8], _routes())]}
    tie = _routes()
    tie[2, 1] = [2, 1]
    ok = default_diff(want, {"spread": [_out([7, 8], tie, logprob=-1.00005)]}, gap_fn)
    assert ok.clean and ok.flips == FlipCount(4, 1, 1, 0, 1e-6) and 4e-5 < ok.max_logprob_diff < 6e-5
    far = tie.copy()
    far[0, 1] = [3, 2]
    bad = default_diff(want, {"spread": [_out([7, 8], far, logprob=-1.001)]}, gap_fn)
    assert bad.flips.far == 1 and len(bad.problems) == 3  # the far entry, and input and output logprobs off by 1e-3
