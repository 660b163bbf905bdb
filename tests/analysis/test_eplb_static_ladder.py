"""Static ladder (r3trace/eplb/static_ladder.py): per layer a layout from the ladder of static-even fixes, the most
static balancedness within DeepSeek global's nodes per token; static_expected_load is static dispatch's expectation;
static_even's tau leaves the lighter mixed experts as they are."""

from __future__ import annotations

from itertools import product
from typing import Literal

import numpy as np
import pytest

from r3trace.eplb import Cluster, global_policy, plan
from r3trace.eplb.cover import cover_sizes
from r3trace.eplb.evaluate import planner_config
from r3trace.eplb.node_model import two_node_dispatch
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.planner import _plan, planning_forecast
from r3trace.eplb.score import balancedness, heat_of, node_counts, node_limited
from r3trace.eplb.static import static_expected_load, static_gpu_load
from r3trace.eplb.static_ladder import NODE_MARGIN, choose, model_static_ladder
from r3trace.eplb.static_spread import mixed, static_even
from tests.analysis.test_eplb_static_spread import per_node, skewed


def test_expected_load_is_every_rank_sending_each_token() -> None:
    e, g = 64, 16
    ids = skewed(1, e, 2, 500, 6, 1.0)
    heat = heat_of(ids, e)
    cl = Cluster(g, 2, 96)
    pl = global_policy(heat, cl)
    uniform = np.repeat(ids, g, axis=0)  # token i from every rank in turn
    got = static_expected_load(pl.phy2log, heat, cl)
    np.testing.assert_allclose(got, static_gpu_load(pl, uniform, cl) / g, rtol=1e-12)
    assert not np.allclose(got, static_expected_load(pl.phy2log, heat, cl, prefer_same_node=False))  # rule 3 counts


def test_tau_fixes_only_the_experts_at_or_above_its_floor() -> None:
    e, g, n, p = 128, 16, 2, 160
    ids = skewed(2, e, 2, 3000, 8, 1.2)
    heat = heat_of(ids, e)
    cl = Cluster(g, n, p)
    ph = global_policy(heat, cl).phy2log
    before = per_node(ph, e, cl)
    left = {}
    for tau in (2.0, 1.0, 0.0):
        after = per_node(static_even(ph, heat, cl, tau), e, cl)
        floor = tau * heat.sum(1) / g  # [L]
        left[tau] = [(layer, x) for layer in range(2) for x in range(e) if mixed(after[layer, x])]
        assert all(heat[layer, x] < floor[layer] for layer, x in left[tau]), tau  # every hot one fixed
    light = [(layer, x) for layer in range(2) for x in range(e) if mixed(before[layer, x])
             and heat[layer, x] < 2.0 * heat[layer].sum() / g]
    assert light and set(light) <= set(left[2.0])  # the light mixed experts stay so under tau = 2 ...
    assert len(left[0.0]) < len(left[1.0]) < len(left[2.0])  # ... and fewer stay as tau falls


def test_choose_by_hand() -> None:
    # two layers; layout 0 the default. Layer 0 gains 0.2 for 0.1 nodes (rate 2), layer 1 0.1 for 0.2 (rate 0.5)
    bal = np.array([[0.6, 0.7], [0.8, 0.8], [0.81, 0.9]])
    nodes = np.array([[2.0, 2.0], [2.1, 2.2], [2.5, 2.3]])
    assert choose(bal, nodes, 4.0).tolist() == [0, 0]  # nothing fits
    assert choose(bal, nodes, 4.1).tolist() == [1, 0]  # the best rate first
    assert choose(bal, nodes, 4.2).tolist() == [1, 0]  # not layer 1's step, which fits alone but gains less
    assert choose(bal, nodes, 4.3).tolist() == [1, 1]  # then layer 1's step
    assert choose(bal, nodes, 4.4).tolist() == [1, 2]  # layer 1's second step (rate 1.0 over layer 0's 0.025)
    assert choose(bal, nodes, 10.0).tolist() == [2, 2]  # everything fits
    assert choose(bal, nodes, 3.0).tolist() == [0, 0]  # over budget from the start: the fewest nodes


def test_choose_is_optimal_on_small_cases_within_a_hull_gap() -> None:
    # against brute force over every combination: within budget, and no worse than the best combination that
    # spends at most the budget less the largest single step (the greedy's known gap on a multiple-choice knapsack)
    rng = np.random.default_rng(3)
    for _ in range(200):
        v, n_layers = 4, 3
        nodes = 2.0 + rng.random((v, n_layers))
        bal = 0.5 + 0.5 * rng.random((v, n_layers))
        budget = float(nodes.min(0).sum() + rng.random() * 1.5)
        pick = choose(bal, nodes, budget)
        got_n, got_b = nodes[pick, range(n_layers)].sum(), bal[pick, range(n_layers)].sum()
        if nodes.min(0).sum() > budget:
            assert np.array_equal(pick, nodes.argmin(0))
            continue
        assert got_n <= budget + 1e-9
        combos = [(nodes[list(c), range(n_layers)].sum(), bal[list(c), range(n_layers)].sum())
                  for c in product(range(v), repeat=n_layers)]
        step = float((nodes.max(0) - nodes.min(0)).max())
        assert got_b >= max((b for n_, b in combos if n_ <= budget - step), default=-np.inf) - 1e-9
        # no single layer's change that fits the budget left raises the sum
        for i in range(n_layers):
            for j in range(v):
                if got_n - nodes[pick[i], i] + nodes[j, i] <= budget + 1e-9:
                    assert bal[j, i] <= bal[pick[i], i] + 1e-9


@pytest.mark.parametrize("g, n, p, s, seed, dispatch", [(16, 2, 288, 1.2, 5, "static"), (32, 4, 288, 1.2, 6, "static"),
                                                        (16, 2, 288, 1.2, 5, "dynamic")])
def test_static_plan_dominates_global_held_out(g: int, n: int, p: int, s: float, seed: int,
                                               dispatch: Literal["static", "dynamic"]) -> None:
    # with the newest tokens the plan for static dispatch keeps nodes per token under DeepSeek global's and its
    # static balancedness above it, held out
    e = 256
    ids = skewed(seed, e, 3, 8000, 8, s)
    train, held = ids[:4000], ids[4000:]
    cl = Cluster(g, n, p, num_groups=8)
    heat = heat_of(train, e)
    glob = global_policy(heat, cl)
    mine = plan(heat, cl, tokens=train, cfg=planner_config(dispatch))
    bal = {k: balancedness(static_gpu_load(pl, held, cl, dispatch=dispatch)) for k, pl in (("ours", mine),
                                                                                          ("global", glob))}
    nodes = {k: float(node_limited(pl, held, cl).nodes.mean()) for k, pl in (("ours", mine), ("global", glob))}
    assert bal["ours"] > bal["global"] + 0.05, bal
    assert nodes["ours"] <= nodes["global"], nodes
    cfg = planner_config("static")
    no_tokens = plan(heat, cl, cfg=cfg)
    if n == 2:  # without tokens the router model counts nodes per token (model_static_ladder), within global's
        w = planning_forecast(heat, None, cfg, cl)[0]
        want = model_static_ladder(_plan(heat, cl, None, None, cfg).phy2log, w, cl, heat, cfg.router)
        np.testing.assert_array_equal(no_tokens.phy2log, want)
        expected = [two_node_dispatch(pl.phy2log, w, cl, *cfg.router)[1].sum() for pl in (no_tokens, glob)]
        assert expected[0] <= expected[1] * (1 - NODE_MARGIN) + 1e-9, expected
        assert float(node_limited(no_tokens, held, cl).nodes.mean()) <= nodes["global"]
    else:  # on more nodes it fixes every mixed expert (static_even)
        assert not any(mixed(x) for layer in per_node(no_tokens.phy2log, e, cl) for x in layer)
    assert any(mixed(x) for layer in per_node(mine.phy2log, e, cl) for x in layer)  # the choice left some mixed
    assert from_phy2log(mine.phy2log, e).logcnt.sum() == cl.num_slots * 3


@pytest.mark.parametrize("g, n, p, seed", [(8, 1, 80, 0), (16, 2, 288, 1), (24, 3, 168, 2), (32, 4, 288, 3),
                                           (64, 8, 320, 4)])
def test_cover_sizes_equal_the_node_limited_cover(g: int, n: int, p: int, seed: int) -> None:
    e = 256 if p >= 256 else 128 if p > 100 else 64
    ids = skewed(seed, e, 3, 1500, 8, 1.0)
    cl = Cluster(g, n, p)
    for pl in (global_policy(heat_of(ids, e), cl), plan(heat_of(ids, e), cl, tokens=ids)):
        masks = ((node_counts(pl, cl) > 0) << np.arange(n)).sum(-1)  # [L, E]
        got = cover_sizes(masks, ids, n).T  # [T, L]
        assert np.array_equal(got, node_limited(pl, ids, cl).nodes)
        assert n == 1 or len(np.unique(got)) > 1


def test_without_a_spare_slot_a_drifting_static_re_plan_is_the_refreshed_one() -> None:
    """P = E: every expert has one replica, so static-even fixes nothing and the drifting re-plan (its locality
    refresh included, then the hot experts' coldest partners: two slots a GPU) is the plan, not the still re-plan it
    would otherwise fall back to (planner._static_even_plan)."""
    from bench.eplb_traces import TraceSpec, synth_windows
    from r3trace.eplb.partners import cold_forecast, coldest_partners
    from r3trace.eplb.planner import _plan, planning_forecast

    spec = TraceSpec(num_experts=64, num_groups=8, top_k=4, num_layers=3, windows=6, window_tokens=1024, drift="fast",
                     zipf_s=1.2, seed=3)
    routes = synth_windows(spec)
    heats = np.stack([heat_of(r, 64) for r in routes]).astype(np.float64)
    cl, cfg = Cluster(32, 8, 64, num_groups=8), planner_config("static")
    prev = plan(heats[:5], cl, tokens=routes[4], cfg=cfg)
    w, moving = planning_forecast(heats, prev, cfg, cl, tokens=routes[5])  # as plan() below makes the call
    assert moving  # the backtest calls drift
    got = plan(heats, cl, prev, tokens=routes[5], cfg=cfg)
    cold = cold_forecast(heats, w, cl, cfg.partner_light)
    want = coldest_partners(_plan(heats, cl, prev, routes[5], cfg).phy2log, w, cl, cfg.hot_partners, cold)
    np.testing.assert_array_equal(got.phy2log, want)
