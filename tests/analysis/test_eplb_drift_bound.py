"""A drifting re-plan judged by the next window's E[max] bound (emax.layout_bound, PlannerConfig.drift_bound_gain):
with many slots a GPU the forecast's max load cannot tell stale replica counts from fresh ones.
Run: .venv/bin/pytest tests/analysis/test_eplb_drift_bound.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, Placement, PlannerConfig, plan
from r3trace.eplb.emax import drift_noise, emax_bound, layout_bound
from r3trace.eplb.fresh import fresh_plan
from r3trace.eplb.homing import capped_counts
from r3trace.eplb.planner import _plan, planning_forecast
from r3trace.eplb.refine import swap_refine
from r3trace.eplb.score import heat_of, node_counts, phy2log_gpu_load

OFF = PlannerConfig(drift_bound_gain=-1.0)


def test_layout_bound_splits_an_experts_variance_over_its_replicas_squared() -> None:
    # two GPUs of two slots, experts of loads 2, 1, 1, 0 (mean GPU load 2). Layout one: the hot expert alone with the
    # idle one, the two cold ones together; layout two: the hot expert's two replicas beside one cold expert each.
    # Both put 2 on each GPU. Variance a w (a = 1): layout one 2 and 1 + 1 a GPU; layout two 2 / 2^2 + 1 = 1.5 (a
    # replica carries half the hot expert's tokens, so half its deviation); in squared mean loads / 4.
    cl = Cluster(2, 1, 4)
    w = np.array([[2.0, 1.0, 1.0, 0.0]])
    one, two = np.array([[0, 3, 1, 2]]), np.array([[0, 1, 0, 2]])
    a, b = np.ones(1), np.zeros(1)
    mu = np.ones((1, 2))
    np.testing.assert_allclose(layout_bound(one, w, cl, a, b), emax_bound(mu, np.full((1, 2), 0.5))[0], rtol=1e-12)
    np.testing.assert_allclose(layout_bound(two, w, cl, a, b), emax_bound(mu, np.full((1, 2), 0.375))[0], rtol=1e-12)
    assert layout_bound(two, w, cl, a, b)[0] < layout_bound(one, w, cl, a, b)[0] - 0.01
    # the multiplicative term b w^2: 4 vs 1 + 1 on layout one, 4 / 4 + 1 = 2 on each GPU of layout two
    a, b = np.zeros(1), np.ones(1)
    np.testing.assert_allclose(layout_bound(one, w, cl, a, b), emax_bound(mu, np.array([[1.0, 0.5]]))[0], rtol=1e-12)
    np.testing.assert_allclose(layout_bound(two, w, cl, a, b), emax_bound(mu, np.full((1, 2), 0.5))[0], rtol=1e-12)


def test_layout_bound_is_an_upper_bound_on_the_sampled_expected_max() -> None:
    rng = np.random.default_rng(11)
    cl = Cluster(8, 1, 48)
    n_layers, e = 2, 40
    w = rng.pareto(1.2, (n_layers, e)) * 40 + 10
    ph = np.stack([rng.permutation(np.concatenate([np.arange(e), rng.choice(e, 8, replace=False)]))
                   for _ in range(n_layers)])
    a, b = np.array([3.0, 0.5]), np.array([0.01, 0.05])
    bound = layout_bound(ph, w, cl, a, b)
    cnt = np.stack([np.bincount(row, minlength=e) for row in ph])
    sd = np.sqrt(a[:, None] * w + b[:, None] * w**2)
    x = w[None] + sd[None] * rng.standard_normal((20000, n_layers, e))  # [S, L, E] the next window's expert loads
    per = np.take_along_axis(x / cnt[None], np.broadcast_to(ph, (20000, *ph.shape)), 2)  # [S, L, P] replica loads
    mean = w.sum(1) / cl.num_gpus
    sampled = (per.reshape(20000, n_layers, cl.num_gpus, -1).sum(3).max(2) / mean).mean(0)  # [L] E[max] / mean
    assert (sampled <= bound).all()
    assert (bound < sampled * 1.2).all()  # and not a loose one: 1.05 and 1.16 x the sampled mean here


def _history(cl: Cluster, family: str, seed: int) -> tuple[np.ndarray, list[np.ndarray], Placement]:
    """A fast-drift trace (3 layers) -> (heats [6, L, E] of its first 6 windows, routes, the placement planned
    through window 4 with the rule off)."""
    spec = TraceSpec(family=family, zipf_s=1.2, drift="fast", num_layers=3, windows=8, seed=seed)  # type: ignore[arg-type]
    routes, _ = load_windows(spec)
    h = np.stack([heat_of(r, 256) for r in routes[:6]])
    prev = None
    for t in range(1, 5):
        prev = plan(h[:t + 1], cl, prev, tokens=routes[t], cfg=OFF)
    assert prev is not None
    return h, routes, prev


@pytest.mark.parametrize("gpus, nodes, family, seed", [(8, 1, "independent", 1), (16, 2, "clustered", 0)])
def test_a_drifting_replan_re_places_the_layers_whose_bound_a_fresh_layout_lowers(gpus: int, nodes: int, family: str,
                                                                                   seed: int) -> None:
    # 288 slots (36 / 18 a GPU), s = 1.2, fast drift: the re-plan on six windows calls drift, and the rule re-places
    # layers 1 and 2 (one node) / layer 2 (two nodes) of the three
    cl = Cluster(gpus, nodes, 288)
    h, routes, prev = _history(cl, family, seed)
    cfg = PlannerConfig()
    w, moving = planning_forecast(h, prev, cfg, cl, tokens=routes[5])  # as _plan below has it
    assert moving
    noise = drift_noise(h, w)
    assert noise is not None
    # before the two-node replay contest (planner._plan), which judges the layouts each gives by another rule
    on, off = _plan(h, cl, prev, routes[5], cfg), _plan(h, cl, prev, routes[5], OFF)
    moved = (on.phy2log != off.phy2log).any(1)  # [L] the layers the rule re-placed
    assert moved.tolist() == ([False, True, True] if nodes == 1 else [False, False, True])
    b_on, b_off = layout_bound(on.phy2log, w, cl, *noise), layout_bound(off.phy2log, w, cl, *noise)
    assert (b_on[moved] < b_off[moved] / (1 + cfg.drift_bound_gain)).all()
    if nodes == 1:  # one node: the re-placed layers take the fresh counts (DeepSeek global's rule)
        np.testing.assert_array_equal(on.logcnt[moved], capped_counts(w, 288, 8)[moved])
    # the rule off: the same re-plan as the in-sample rule alone, which re-placed fewer slots
    assert (on.phy2log != prev.phy2log).sum() > (off.phy2log != prev.phy2log).sum()


def test_a_drifting_one_node_replan_re_places_every_layer_up_whatever_its_gain_ranks() -> None:
    # 8 GPUs / 1 node / 288 slots, clustered router, s = 1.2, fast drift, 6 layers: the bound calls layers 1, 2 and 5
    # up while layers 3 and 4, not up (their forecast gain and bound ratio both under the thresholds), have a larger
    # gain; a re-plan cut at the first layer not up in gain order kept all six layers
    cl = Cluster(8, 1, 288)
    spec = TraceSpec(family="clustered", zipf_s=1.2, drift="fast", num_layers=6, windows=8, seed=0,
                     window_tokens=2048)
    routes, _ = load_windows(spec)
    h = np.stack([heat_of(r, 256) for r in routes[:7]])
    prev = None
    for t in range(1, 6):
        prev = plan(h[:t + 1], cl, prev, tokens=routes[t])
    assert prev is not None
    cfg = PlannerConfig()
    w, moving = planning_forecast(h, prev, cfg, cl)
    assert moving
    noise = drift_noise(h, w)
    assert noise is not None
    # the two sides of the rule, as _plan forms them: the previous placement after its swaps, and a fresh plan
    kept = swap_refine(prev.phy2log, w, prev.logcnt, cl, int(cfg.replan_swap_share * 288 / 2), cfg.min_gain,
                       cross_nodes=True)
    fresh = fresh_plan(w, node_counts(prev, cl).argmax(2), cl, cfg, routes[6])
    gain = phy2log_gpu_load(kept, w, cl).max(1) / phy2log_gpu_load(fresh.phy2log, w, cl).max(1)
    held = layout_bound(kept, w, cl, *noise) / layout_bound(fresh.phy2log, w, cl, *noise)
    up = (gain > 1 + cfg.keep_tolerance) | (held > 1 + cfg.drift_bound_gain)
    assert up.tolist() == [False, True, True, False, False, True]
    ranked = np.maximum(gain, held)
    assert ranked[~up].max() > ranked[up].min()  # the case: a layer not up outranks one that is
    out = plan(h, cl, prev, tokens=routes[6])
    assert (out.phy2log != kept).any(1).tolist() == up.tolist()
    # each re-placed layer is the fresh layout moved onto the previous GPUs: the same GPU loads, reordered
    np.testing.assert_allclose(np.sort(phy2log_gpu_load(out.phy2log[up], w[up], cl), axis=1),
                               np.sort(phy2log_gpu_load(fresh.phy2log[up], w[up], cl), axis=1), rtol=1e-12)
