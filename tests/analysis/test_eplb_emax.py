"""E[max] swaps (emax.py): a still re-plan with two slots per GPU lowers a bound on the next window's expected max GPU
load within its churn budget. Run: .venv/bin/pytest tests/analysis/test_eplb_emax.py -q"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, Placement, PlannerConfig, churn, plan
from r3trace.eplb.emax import emax_bound, emax_swaps, layout_bound, layout_bounds, replan_noise, variance_model
from r3trace.eplb.forecast import backtest_errors, drifts, forecast
from r3trace.eplb.planner import planning_forecast
from r3trace.eplb.scenarios import deviations
from r3trace.eplb.score import heat_of


def _dev(var: np.ndarray) -> np.ndarray:
    """[L, E] variances -> [4, L, E] deviations whose squares sum to 3 x var (variance_model divides by K - 1)."""
    s = np.sqrt(0.75 * var)
    return np.stack([s, -s, s, -s])


def test_the_variance_model_recovers_its_terms_and_drops_a_negative_one() -> None:
    w = np.stack([np.linspace(20.0, 300.0, 64), np.linspace(20.0, 300.0, 64)])
    var = np.stack([2.0 * w[0] + 0.04 * w[0] ** 2, 0.04 * w[1] ** 2 - 0.5 * w[1]])  # layer 1: a would be < 0
    a, b = variance_model(_dev(var), w)
    np.testing.assert_allclose([a[0], b[0]], [2.0, 0.04], rtol=1e-9)
    assert a[1] == 0.0 and 0.035 < b[1] < 0.04  # b alone, least squares


def _bound(phy2log: np.ndarray, w: np.ndarray, cl: Cluster, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[L] emax_bound of a layout: GPU means and variances (a u + b u^2 a replica) in mean GPU loads."""
    cnt = np.stack([np.bincount(row, minlength=w.shape[1]) for row in phy2log])
    per = np.take_along_axis(w / cnt, phy2log, 1)
    m = w.sum(1, keepdims=True) / cl.num_gpus
    n_layers = len(w)
    mu = (per / m).reshape(n_layers, cl.num_gpus, -1).sum(2)
    var = ((a[:, None] * per + b[:, None] * per**2) / m**2).reshape(n_layers, cl.num_gpus, -1).sum(2)
    return emax_bound(mu, var)[0]


def test_emax_swaps_keep_anchors_and_counts_stay_in_budget_and_lower_the_bound() -> None:
    rng = np.random.default_rng(3)
    cl = Cluster(24, 6, 48, num_groups=4)  # 2 slots a GPU, 8 spare slots
    n_layers, e = 3, 40
    w = rng.pareto(1.0, (n_layers, e)) * 50 + 5
    ph = np.stack([rng.permutation(np.concatenate([np.arange(e), rng.choice(e, 8, replace=False)]))
                   for _ in range(n_layers)])
    a, b = np.full(n_layers, 1.0), np.full(n_layers, 0.04)
    swaps = np.array([0, 2, 50])
    out = emax_swaps(ph, w, cl, swaps, a, b)
    for layer in range(n_layers):
        np.testing.assert_array_equal(np.bincount(out[layer], minlength=e), np.bincount(ph[layer], minlength=e))
        assert ((out[layer] != ph[layer]).sum()) <= 2 * swaps[layer]
        two = out[layer].reshape(-1, 2)
        assert (two[:, 0] != two[:, 1]).all()  # never an expert twice on a GPU
    np.testing.assert_array_equal(out[0], ph[0])
    # every GPU keeps its heavier replica (the lighter ones are swapped)
    cnt = np.bincount(ph[2], minlength=e)
    u = (w[2] / cnt)[ph[2]].reshape(-1, 2)
    heavy = ph[2].reshape(-1, 2)[np.arange(cl.num_gpus), u.argmax(1)]
    assert all(heavy[i] in out[2].reshape(-1, 2)[i] for i in range(cl.num_gpus))
    before, after = _bound(ph, w, cl, a, b), _bound(out, w, cl, a, b)
    assert (after <= before + 1e-12).all() and after[2] < before[2] - 0.01


class _Replans(NamedTuple):
    h: np.ndarray  # [5, L, E] the windows' loads
    routes: list[np.ndarray]  # their tokens
    first: Placement  # planned on the first 4
    on: Placement  # the still re-plan on all 5, with E[max] swaps
    off: Placement  # and without
    w: np.ndarray  # [L, E] the still forecast (alpha_tie: the longest memory)
    a: np.ndarray  # [L] the variance model's terms
    b: np.ndarray


def _still_replans(cl: Cluster, layers: int) -> _Replans:
    """A grouped router's 5 windows (seed 1, s = 0.6) planned on cl: the first 4, then a still re-plan of all 5."""
    routes, _ = load_windows(TraceSpec(num_layers=layers, windows=5, window_tokens=4096, seed=1))
    h = np.stack([heat_of(r, 256) for r in routes])
    assert not drifts(h, backtest_errors(h), PlannerConfig().refresh_drift)  # a still re-plan
    solo = PlannerConfig(hot_partners=0)  # the E[max] swaps alone: the hot partners (partners.py) take their place
    first = plan(h[:4], cl, tokens=routes[3], cfg=solo)
    on = plan(h, cl, first, tokens=routes[4], cfg=solo)
    off = plan(h, cl, first, tokens=routes[4], cfg=replace(solo, emax_swaps=False))
    w = forecast(h, 0.0)
    dev = deviations(h, w, 8)
    assert dev is not None
    a, b = variance_model(dev, w)
    return _Replans(h, routes, first, on, off, w, a, b)


def test_a_still_replan_lowers_the_expected_max_bound_within_its_budget() -> None:
    # 144 GPUs / 18 nodes / 288 slots, grouped router, slow drift (bench/eplb_matrix.py's missed cells, 2 layers).
    # Measured (the bound in mean GPU loads, layers 0 / 1): 1.941 / 1.825 with the E[max] swaps, 1.961 / 1.843 without
    # (leveling, pairing and hot swaps); churn 0.087. Seeds 0-5: lower in every layer, by 0.001-0.020
    cl = Cluster(144, 18, 288)
    r = _still_replans(cl, 2)
    first, on, off, w, a, b = r.first, r.on, r.off, r.w, r.a, r.b
    assert (_bound(on.phy2log, w, cl, a, b) < _bound(off.phy2log, w, cl, a, b) - 0.01).all()
    assert churn(first, on) <= PlannerConfig().seeded_churn_budget


def _nodes(phy2log: np.ndarray, cl: Cluster) -> np.ndarray:
    """phy2log [L, P] with every expert once -> [L, E] each expert's node."""
    return np.argsort(phy2log, axis=1, kind="stable") // cl.slots_per_node


def test_without_a_spare_slot_only_lone_light_replicas_cross_nodes() -> None:
    rng = np.random.default_rng(5)
    cl = Cluster(16, 4, 32, num_groups=4)  # 2 slots a GPU, P = E
    n_layers, e = 3, 32
    w = rng.pareto(1.0, (n_layers, e)) * 50 + 5
    ph = np.stack([rng.permutation(e) for _ in range(n_layers)])
    a, b = np.full(n_layers, 1.0), np.full(n_layers, 0.04)
    swaps = np.full(n_layers, 12)
    inside = emax_swaps(ph, w, cl, swaps, a, b, cross_below=np.full(n_layers, -np.inf))
    free = emax_swaps(ph, w, cl, swaps, a, b)
    np.testing.assert_array_equal(_nodes(inside, cl), _nodes(ph, cl))  # swaps inside nodes: every node set kept
    assert (_bound(inside, w, cl, a, b) < _bound(ph, w, cl, a, b) - 1e-3).all()
    assert (_nodes(free, cl) != _nodes(ph, cl)).any()  # unconstrained, experts do change node here
    below = np.array([0.3, 0.3, -np.inf])  # in mean GPU loads
    cold = emax_swaps(ph, w, cl, swaps, a, b, cross_below=below)
    crossed = _nodes(cold, cl) != _nodes(ph, cl)
    light = w / (w.sum(1, keepdims=True) / cl.num_gpus) < below[:, None]
    assert crossed.any() and not (crossed & ~light).any()  # only replicas below the limit change node
    # a swap must lower the bound by more than step_drop mean GPU loads: none does by 10
    np.testing.assert_array_equal(emax_swaps(ph, w, cl, swaps, a, b, step_drop=10.0), ph)


def test_a_still_replan_without_a_spare_slot_spends_what_is_left_on_the_bound() -> None:
    # 128 GPUs / 16 nodes / 256 slots, grouped router (s = 0.6, seed 1; bench/eplb_matrix.py's P = E cells, 3 layers).
    # Measured (the bound in mean GPU loads, layer 1): 6.4051 with the E[max] swaps after the seeded re-plan, 6.4060
    # without; churn 0.034 / 0.031; two experts of layer 0 changed node (nodes per token 6.6% under global's there)
    cl = Cluster(128, 16, 256)
    r = _still_replans(cl, 3)
    first, on, off, w, a, b = r.first, r.on, r.off, r.w, r.a, r.b
    low, high = _bound(on.phy2log, w, cl, a, b), _bound(off.phy2log, w, cl, a, b)
    assert (low <= high + 1e-12).all() and (low < high - 5e-4).any()
    assert churn(first, on) <= PlannerConfig().seeded_churn_budget
    crossed = _nodes(on.phy2log, cl) != _nodes(off.phy2log, cl)  # [L, E]
    light = w / (w.sum(1, keepdims=True) / cl.num_slots) < PlannerConfig().level_cold
    assert crossed.any() and not (crossed & ~light).any()
    # no layer has 50% fewer nodes per token than global's: then every swap stays inside its node
    tight = plan(r.h, cl, first, tokens=r.routes[4], cfg=PlannerConfig(emax_node_slack=0.5, hot_partners=0))
    np.testing.assert_array_equal(_nodes(tight.phy2log, cl), _nodes(off.phy2log, cl))


def test_a_drifting_replan_with_a_spare_slot_ends_with_emax_swaps() -> None:
    # 144 GPUs / 18 nodes / 288 slots, independent router, s = 0.6, fast drift (bench/eplb_matrix.py's cell that
    # trailed global on the newest window, 3 layers): the fourth plan is a drifting re-plan (replan.refreshed), and
    # PlannerConfig.drift_emax_swaps then lowers the bound of the layers taking the fresh layout, on the re-plan's own
    # forecast and noise model.
    # Measured (the bound in mean GPU loads): layer 1 2.023 with the swaps against 2.043 without, at the same forecast
    # max load (1.312 x the mean); every layer took the fresh layout, layers 0 and 2 gained under min_gain and kept
    # theirs; 79.5-83.0% of slots moved either way (the swaps come before the alignment to prev)
    cl = Cluster(144, 18, 288)
    spec = TraceSpec(family="independent", zipf_s=0.6, drift="fast", num_layers=3, windows=5, seed=2)
    routes, _ = load_windows(spec)
    h = np.stack([heat_of(r, 256) for r in routes])
    prev = None
    for t in range(2, 5):
        prev = plan(h[:t], cl, prev, tokens=routes[t - 1])
    assert prev is not None
    cfg = PlannerConfig()
    w, moving = planning_forecast(h, prev, cfg, cl)
    assert moving  # the backtest calls drift
    on = plan(h, cl, prev, tokens=routes[4])
    off = plan(h, cl, prev, tokens=routes[4], cfg=PlannerConfig(drift_emax_swaps=0))
    noise = replan_noise(h, w, cl)
    assert noise is not None
    low, high = _bound(on.phy2log, w, cl, *noise), _bound(off.phy2log, w, cl, *noise)
    np.testing.assert_array_equal(on.logcnt, off.logcnt)  # swaps only: every expert keeps its replica count
    assert (low <= high + 1e-12).all() and (low < high - 0.01).any()
    # the layers whose bound fell under min_gain (0 and 2) keep the fresh layout as it was
    assert (on.phy2log != off.phy2log).any(1).tolist() == [False, True, False]


def test_layout_bounds_equal_one_call_a_layout() -> None:
    """emax.layout_bounds (V layouts in one call over V L rows) gives each layout's layout_bound, bit for bit."""
    rng = np.random.default_rng(31)
    for g, n, spg, e in [(16, 2, 18, 256), (8, 1, 4, 32), (128, 16, 2, 256)]:
        cl = Cluster(g, n, g * spg)
        w = rng.pareto(1.0, (5, e)) * 10 + 1
        a, b = rng.random(5), rng.random(5) * 0.1
        lays = [np.stack([rng.permutation(np.concatenate([np.arange(e), rng.integers(0, e, g * spg - e)]))
                          for _ in range(5)]) for _ in range(3)]
        got = layout_bounds(lays, w, cl, a, b)
        want = np.stack([layout_bound(x, w, cl, a, b) for x in lays])
        assert got.shape == (3, 5) and np.array_equal(got, want)
        assert len(np.unique(got[:, 0])) == 3  # the layouts differ in bound
