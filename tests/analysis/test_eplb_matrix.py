"""The EPLB matrix (bench/eplb_matrix.py) in its smoke size, and the 8-node shape where ours fell back to
DeepSeek's hierarchical layout. Run: .venv/bin/pytest tests/analysis/test_eplb_matrix.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from bench.eplb_matrix import TraceSpec, cells, run_cell
from bench.eplb_matrix_results import METRICS, dominates, summary, updated
from bench.eplb_traces import sglang_dump, synth_windows
from r3trace.analysis.synth import SynthConfig, route_windows
from r3trace.eplb import Cluster, PlannerConfig, churn, global_policy, hierarchical, plan
from r3trace.eplb.fresh import layout
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of, node_limited


def test_smoke_matrix_scores_every_policy_on_every_held_out_window() -> None:
    for cell in cells("smoke", TraceSpec()):
        res = run_cell(cell)
        n_scored = cell.spec.windows - 3  # plans at t = 1 .. W - 2, the first one (cold start) unscored
        pols = res["policies"]
        assert {"global", "global-newest", "grace", "ours"} <= set(pols)
        assert ("hierarchical" in pols) == (cell.spec.num_groups % cell.nodes == 0)
        for name, rows in pols.items():
            assert all(len(rows[m]) == n_scored for m in METRICS), name
            assert all(0 < b <= 1 for b in rows["bal_even"] + rows["bal_node_limited"]), name
            assert all(1 <= x <= min(cell.nodes, cell.spec.top_k) for x in rows["nodes"]), name
        if cell.spec.family != "sample":  # slow drift: the re-plans' own budget (9.5% of slots)
            assert max(pols["ours"]["churn"]) <= 0.10
        # the sample model's windows drift (backtest ratio 1.81 and 1.30, forecast.drifts): ours may re-place more
        assert min(pols["global"]["churn"]) > 0.5  # a stateless policy re-places most slots
        s = summary(res, "global")
        assert s["global"]["bal_even"][1:] == [0.0, 0.0]  # paired against itself
        assert set(dominates(res)) >= {"bal_even>=global", "nodes<=global"}


def test_synthetic_families_differ_in_co_activation_and_drift_moves_popularity() -> None:
    base = TraceSpec(num_layers=1, windows=3, window_tokens=2048, zipf_s=0.6)
    lift = {}
    for fam in ("grouped", "clustered", "independent"):
        r = synth_windows(TraceSpec(**{**base.__dict__, "family": fam}))
        assert r.shape == (3, 2048, 1, 8) and all(len(set(row)) == 8 for row in r[0, :50, 0])
        onehot = np.zeros((2048, 256))
        np.put_along_axis(onehot, r[0, :, 0].astype(np.int64), 1.0, 1)
        c = onehot.T @ onehot
        n = np.diag(c).copy()
        np.fill_diagonal(c, 0)
        pair = np.outer(n, n)
        # co-choices over what independent choices would give, mean of the 100 strongest well-sampled pairs
        lift[fam] = np.sort((c * 2048 / np.maximum(pair, 1))[pair >= 400])[-100:].mean()
    # measured 7.86 / 7.43 / 6.77: domains and topics add co-activation beyond popularity and the group limit
    assert lift["grouped"] > lift["clustered"] > lift["independent"] + 0.3
    specs = {d: TraceSpec(**{**base.__dict__, "drift": d, "windows": 6}) for d in ("slow", "fast")}
    heat = {d: np.stack([heat_of(w, 256) for w in synth_windows(sp)]) for d, sp in specs.items()}
    moved = {d: np.abs(h[-1] / h[-1].sum() - h[0] / h[0].sum()).sum() for d, h in heat.items()}
    assert moved["fast"] > 1.5 * moved["slow"]
    dump = sglang_dump(r[0], 256, forwards=16)
    assert dump.shape == (16, 1, 256) and np.array_equal(dump.sum(0), heat_of(r[0], 256))


def test_ours_on_eight_nodes_beats_global_on_the_newest_window_and_the_old_hierarchical_fallback() -> None:
    # 64 GPUs / 8 nodes / 320 slots, 8 groups, node limit 4: ours used DeepSeek's hierarchical layout here (0.63
    # vs global's 0.82 held out in the issue). Rolling: plan at the end of window t (ours from its previous
    # placement), score on t + 1. Measured (seed 3): ours 0.836 even / 0.775 node-limited at 3.70 nodes per
    # token; global on the newest window 0.817 / 0.725 at 4.93; hierarchical 0.678.
    cl = Cluster(64, 8, 320)
    wins = route_windows(SynthConfig(num_hidden_layers=7, zipf_s=0.6, seed=3, bank_size=2048), 6, 4096,
                         np.random.default_rng(3))
    heats = np.stack([heat_of(w, 256) for w in wins])
    prev, rows = None, []
    for t in range(1, 5):
        pl = plan(heats[:t + 1], cl, prev, tokens=wins[t])
        if prev is not None:
            assert churn(prev, pl) <= 0.10
            glob, hier = global_policy(heats[t], cl), hierarchical(heats[t], cl)
            d_ours, d_glob = node_limited(pl, wins[t + 1], cl), node_limited(glob, wins[t + 1], cl)
            rows.append([balancedness(even_gpu_load(x, heats[t + 1], cl)) for x in (pl, glob, hier)]
                        + [balancedness(d_ours.gpu_load), balancedness(d_glob.gpu_load), d_ours.nodes.mean(),
                           d_glob.nodes.mean()])
        prev = pl
    ours, glob, hier, nl_ours, nl_glob, n_ours, n_glob = np.mean(rows, axis=0)
    assert ours >= glob and nl_ours >= nl_glob and n_ours <= n_glob - 1.0
    assert ours >= hier + 0.1
    assert layout(cl).name == "spread" and layout(cl, PlannerConfig(keep_groups=True)).name == "groups_on_nodes"
    again = plan(heats[:5], cl, prev, tokens=wins[4])  # the same windows once more: a stable re-plan
    assert churn(prev, again) <= 0.10  # the goal for an unchanged workload
    keep = plan(heats[:5], cl, tokens=wins[4], cfg=PlannerConfig(keep_groups=True))
    assert node_limited(keep, wins[5], cl).nodes.max() <= cl.node_limit  # whole groups: the node limit holds


def test_update_replaces_the_cells_it_ran_and_keeps_the_rest() -> None:
    args = {"layers": 6, "windows": 20, "window_tokens": 4096, "seed": 1}
    old = {"sweep": "shape", "args": {**args, "nodes": []}, "machine": {"cpu": "a"},
           "results": [{"cell": c, "v": 0} for c in ("x", "y", "z")]}
    new = {"sweep": "shape", "args": {**args, "nodes": [18]}, "machine": {"cpu": "b"},
           "results": [{"cell": "y", "v": 1}]}
    out = updated(old, new)
    assert out["results"] == [{"cell": "x", "v": 0}, {"cell": "y", "v": 1}, {"cell": "z", "v": 0}]
    assert out["args"] == old["args"] and out["updates"] == [{"args": new["args"], "machine": {"cpu": "b"}}]
    assert updated(out, new)["updates"][1]["args"]["nodes"] == [18]  # a second update is listed after the first
    for bad in ({**new, "args": {**new["args"], "seed": 2}}, {**new, "sweep": "family"},
                {**new, "results": [{"cell": "w", "v": 1}]}):
        with pytest.raises(SystemExit, match="--update"):
            updated(old, bad)
