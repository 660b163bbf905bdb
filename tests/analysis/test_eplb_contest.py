"""candidates.Contest: best_layout's per-layer choice made on demand, as a drifting re-plan uses it.
Run: .venv/bin/pytest tests/analysis/test_eplb_contest.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, PlannerConfig, candidates, from_phy2log, global_policy, plan, planner
from r3trace.eplb.candidates import Contest, best_layout, losing_load, paired_se
from r3trace.eplb.forecast import backtest_errors, drifts, forecast, pick_alpha
from r3trace.eplb.fresh import spread_cap, spread_layout
from r3trace.eplb.replan import refreshed
from r3trace.eplb.score import even_gpu_load, heat_of

CL = Cluster(64, 8, 256)  # no spare slot: the choice regroups with tokens


def _inputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """([W, L, E] loads, [W, T, L, K] routes) of 12 layers, fast drift; 1030 tokens a window, so the halves the
    choice counts on (515) are no power of two and its means and deviations are rounded."""
    routes = load_windows(TraceSpec(num_layers=12, windows=5, window_tokens=1030, drift="fast", seed=seed))[0]
    return np.stack([heat_of(w, 256) for w in routes]), routes


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_a_contest_gives_best_layouts_rows_and_max_loads_without_choosing_every_layer(seed: int) -> None:
    heats, routes = _inputs(seed)
    w, tok = forecast(heats, 0.5), routes[-1]
    ours = spread_layout(w, CL, PlannerConfig(), tok)
    full = best_layout(ours, w, CL, tok)  # every layer chosen, in one stack
    contest = Contest(ours, w, CL, tok)
    peak = contest.peak()
    # the max loads equal those of the full choice, while only the layers whose tied candidates differ were chosen
    np.testing.assert_array_equal(peak, even_gpu_load(from_phy2log(full, 256), w, CL).max(1))
    assert 0 < contest.done.sum() < len(w) // 2
    # any subset, one layer alone included, gets the full choice's rows
    for rows in (np.array([5]), np.array([11, 0, 3]), np.arange(len(w))):
        np.testing.assert_array_equal(Contest(ours, w, CL, tok).layouts(rows), full[rows])


@pytest.mark.parametrize("seed", [0, 2, 3])
@pytest.mark.parametrize("gain", [0.02, -1.0])
def test_a_drifting_replan_equals_the_one_with_every_layer_chosen_first(seed: int, gain: float) -> None:
    """The default re-plan keeps the seeded plan on these inputs; a gain of -1 makes every layer the fresh plan
    lowers take it, so layouts of layers chosen only for that are used too."""
    heats, routes = _inputs(seed)
    cfg = PlannerConfig(refresh_gain=gain)
    prev = plan(heats[:4], CL, tokens=routes[3])
    w, tok = forecast(heats, 0.5), routes[4]
    ours = spread_layout(w, CL, cfg, tok)
    eager = Contest(ours, w, CL, tok)
    eager.layouts(np.arange(len(w)))  # the unskipped path: every layer's choice made
    lazy = Contest(ours, w, CL, tok)
    got = refreshed(lazy, w, prev, CL, cfg, spread_cap(CL), tok)
    np.testing.assert_array_equal(got, refreshed(eager, w, prev, CL, cfg, spread_cap(CL), tok))
    assert not lazy.done.all()
    if gain < 0:  # layers took the fresh plan, chosen after their max loads were known (more than those needed)
        just_peak = Contest(ours, w, CL, tok)
        just_peak.peak()
        assert (got != prev.phy2log).mean() > 0.1 and lazy.done.sum() > just_peak.done.sum()


@pytest.mark.parametrize("seed", [1, 3])  # seeds whose history calls drift
def test_a_drifting_replan_equals_the_one_with_ours_leveled_in_every_layer(seed: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Ours' leveling stops in layers out of reach of global's max load (fresh.spread_layout, losing_load): the
    re-plan is the one with every layer leveled in full, though ours' layout differs in some layers."""
    cl = Cluster(64, 8, 320)  # 5 slots a GPU: neither polish nor pairing follows the leveling
    heats, routes = _inputs(seed)
    prev = plan(heats[:4], cl, tokens=routes[3])
    got = plan(heats, cl, prev, tokens=routes[4])
    err = backtest_errors(heats)
    assert err is not None and drifts(heats, err, PlannerConfig().refresh_drift)  # the re-plan refreshes ...
    # ... on this forecast
    w, tok = forecast(heats, pick_alpha(err, 0.0)), routes[4]
    bar = losing_load(global_policy(w, cl).phy2log, w, cl)
    assert (spread_layout(w, cl, PlannerConfig(), tok, bar) != spread_layout(w, cl, PlannerConfig(), tok)).any()
    monkeypatch.setattr(planner, "losing_load", lambda glob, w, cluster: np.full(len(w), np.inf))
    np.testing.assert_array_equal(got.phy2log, plan(heats, cl, prev, tokens=routes[4]).phy2log)


def test_paired_se_gives_a_layer_alone_the_bits_it_gets_in_a_stack() -> None:
    # the choice's noise figure: numpy's std sums a lone column pairwise and a stack's columns row by row, and on
    # these counts the two differ in the last bits; the integer sums do not
    d = np.random.default_rng(0).integers(-3, 4, size=(515, 6))
    alone = np.array([paired_se(d[:, [i]])[0] for i in range(6)])
    assert np.array_equal(paired_se(d), alone)
    np.testing.assert_allclose(alone, d.std(0, ddof=1) / np.sqrt(515), rtol=1e-12)
    assert not np.array_equal(d.std(0, ddof=1), [d[:, [i]].std(0, ddof=1)[0] for i in range(6)])
    assert np.isnan(paired_se(d[:1])).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_regrouping_global_only_within_reach_changes_no_choice(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # REGROUP_REACH skips regrouping global's layer where its plain count is far above the best tied rival's; on
    # these inputs regrouping it in every tied layer picks the same layouts, and a reach of 1.0 would not
    heats, routes = _inputs(seed)
    w, tok = forecast(heats, 0.5), routes[-1]
    ours = spread_layout(w, CL, PlannerConfig(), tok)
    got = best_layout(ours, w, CL, tok)
    monkeypatch.setattr(candidates, "REGROUP_REACH", float("inf"))
    np.testing.assert_array_equal(got, best_layout(ours, w, CL, tok))
    monkeypatch.setattr(candidates, "REGROUP_REACH", 1.0)
    assert not np.array_equal(got, best_layout(ours, w, CL, tok))
