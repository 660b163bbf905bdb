"""Two nodes without tokens (r3trace/eplb/static_ladder.replay_ladder, node_model.two_node_dispatch): the router model's
expected node-limited loads and nodes per token against a Monte Carlo of that model written from its doc, and the
planner's use of the ladder (still and fresh plans, within global's nodes per token), which pays held out under
node-limited dispatch on a workload whose tokens co-locate by domain.

Run: .venv/bin/pytest -q tests/analysis/test_eplb_replay_ladder.py
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, PlannerConfig, churn, plan
from r3trace.eplb.deepseek import global_phy2log
from r3trace.eplb.drift_call import drift_call
from r3trace.eplb.evaluate import planner_config
from r3trace.eplb.node_model import router_odds, two_node_dispatch
from r3trace.eplb.placement import replicas_per_node
from r3trace.eplb.planner import _plan, planning_forecast
from r3trace.eplb.score import balancedness, heat_of, node_limited
from r3trace.eplb.static_ladder import NODE_MARGIN, replay_ladder
from tests.analysis.test_eplb_dispatch_contest import GROUPS, LAYERS, E, grouped_routes


def monte_carlo(phy2log: np.ndarray, w: np.ndarray, cl: Cluster, top_k: int, topk_group: int, n: int,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One layer [P], loads [E] -> (GPU loads [G], nodes per token) over n tokens of the model: each group taken with
    q_g, each expert of a taken group with p_e; a token fitting one node sends each expert's unit to that node's
    replicas (fitting both: half to each), else over all its replicas; each drawn unit of e weighs w_e / (q_g p_e n),
    so e's expected load is w_e, as the model takes the forecast's (where q or p is clipped at 1 the draws alone would
    not)."""
    e = len(w)
    q, p = (x[0] for x in router_odds(w[None], cl.num_groups, top_k, topk_group))
    cnt = replicas_per_node(phy2log[None], e, cl)[0]  # [E, 2]
    gsize = e // cl.num_groups
    taken = rng.random((n, cl.num_groups)) < q  # [n, G]
    chosen = (rng.random((n, e)) < p) & np.repeat(taken, gsize, axis=1)  # [n, E]
    fit0 = ~(chosen & (cnt[:, 0] == 0)).any(1)
    fit1 = ~(chosen & (cnt[:, 1] == 0)).any(1)
    weight = w / (np.repeat(q, gsize) * p * n)  # [E] each drawn unit's load
    units = np.zeros((e, 2))  # [E, 2] load of each expert served on each node
    for share0, rows in ((1.0, fit0 & ~fit1), (0.0, fit1 & ~fit0), (0.5, fit0 & fit1)):
        per = chosen[rows].sum(0) * weight
        units[:, 0] += share0 * per
        units[:, 1] += (1 - share0) * per
    both = chosen[~fit0 & ~fit1].sum(0) * weight  # split over all replicas
    units += both[:, None] * cnt / cnt.sum(1, keepdims=True)
    per_replica = units / np.maximum(cnt, 1)
    slot = per_replica[phy2log, cl.slot_node()]
    load = slot.reshape(cl.num_gpus, -1).sum(1)
    nodes = np.where(fit0 | fit1, 1, 2)[chosen.any(1)]
    return load, float(nodes.mean())


@pytest.mark.parametrize("seed", [0, 1])
def test_two_node_dispatch_equals_a_monte_carlo_of_its_model(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cl = Cluster(8, 2, 48, num_groups=4)  # 32 experts, 16 replicas spare
    w = 100.0 / (1 + rng.permutation(32)) ** 1.2
    pl = plan(w[None], cl)  # co-located group homes: many tokens fit one node
    phy = pl.phy2log[0]
    load, nodes = two_node_dispatch(pl.phy2log, w[None], cl, 4, 2)
    mc_load, mc_nodes = monte_carlo(phy, w, cl, 4, 2, 400_000, rng)
    # 400k tokens: the units of a GPU are sums of ~1e5 draws, their relative SE ~0.3%; nodes' SE ~0.001
    np.testing.assert_allclose(load[0], mc_load, rtol=0.02)
    assert abs(nodes[0] - mc_nodes) < 0.005
    assert 1.0 < nodes[0] < 2.0
    # an expert's replicas all on one node or one a node: none is skewed, each GPU's load its replicas' even share
    even = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]).ravel()
    cl2 = Cluster(2, 2, 16, num_groups=4)
    w2 = np.arange(1.0, 17.0)
    load2, _ = two_node_dispatch(even[None], w2[None], cl2, 2, 2)
    np.testing.assert_allclose(load2[0], [w2[:8].sum(), w2[8:].sum()])


def _hidden(seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """[W, L, E] heat of an unchanged grouped workload (4 domains, 2,000 tokens a window) and its routes."""
    rng = np.random.default_rng(seed)
    rank, bias = rng.permutation(E), rng.normal(0, 0.5, (4, LAYERS, E))
    wins = [grouped_routes(np.random.default_rng(50 + i), 2000, rank, bias) for i in range(10)]
    return np.stack([heat_of(w, E) for w in wins]), wins


def test_a_two_node_plan_without_tokens_takes_the_ladder_within_global_nodes() -> None:
    """Heat only (an SGLang dump): fresh and still re-plans are replay_ladder of the plan before it, within global's
    expected nodes per token less NODE_MARGIN, a re-plan's within the churn budget; held out on the next window's
    (hidden) tokens that pays under node-limited dispatch against the plans without it (0.8605 -> 0.8640 mean
    over 7 re-plans, 10 of 16 layer plans laddered); the replay margin off: none."""
    two = Cluster(16, 2, 160, num_groups=GROUPS)
    heats, wins = _hidden(3)
    cfg = PlannerConfig()
    prev, held_new, held_old, changed = None, [], [], 0
    for t in range(1, 9):
        h = heats[max(0, t - 7):t + 1]
        w, moving = planning_forecast(h, prev, cfg, two)
        raw = _plan(h, two, prev, None, cfg)
        got = plan(h, two, prev)
        assert not moving
        want = replay_ladder(raw.phy2log, w, two, h.sum(0), cfg.router, None if prev is None else prev.phy2log,
                             cfg.seeded_churn_budget)
        np.testing.assert_array_equal(got.phy2log, want)
        if prev is not None:  # a re-plan keeps the unchanged workload's churn budget
            assert churn(prev, got) <= cfg.seeded_churn_budget
        changed += int((got.phy2log != raw.phy2log).any(1).sum())
        ours = two_node_dispatch(got.phy2log, w, two, *cfg.router)[1].sum()
        theirs = two_node_dispatch(global_phy2log(h.sum(0), two), w, two, *cfg.router)[1].sum()
        assert ours <= theirs * (1 - NODE_MARGIN) + 1e-9 or (got.phy2log == raw.phy2log).all()
        if prev is not None:
            held_new.append(balancedness(node_limited(got, wins[t + 1], two).gpu_load))
            held_old.append(balancedness(node_limited(raw, wins[t + 1], two).gpu_load))
        prev = got
    assert changed >= 4
    assert np.mean(held_new) > np.mean(held_old) + 0.002
    off = PlannerConfig(replay_margin=-1.0)
    np.testing.assert_array_equal(plan(heats[:2], two, cfg=off).phy2log, _plan(heats[:2], two, None, None, off).phy2log)


def test_a_drift_call_on_two_nodes_without_tokens_is_held_and_takes_the_whole_ladder() -> None:
    """Heat only, fast drift (bench/eplb_traces.py, s = 1.2): where the backtest calls drift the call is held
    (drift_call.py): the re-plan is the still one, on the still forecast and the seeded layout, then replay_ladder with
    no churn budget; with hold_two_node_drift off the same history re-plans drifting. The held-out figures of
    bench/eplb_matrix.py's SGLang-dump cells are in drift_call.py's doc."""
    cl = Cluster(16, 2, 288)
    routes, _ = load_windows(TraceSpec(family="grouped", zipf_s=1.2, drift="fast", num_layers=4, windows=8, seed=0,
                                       window_tokens=2048))
    heats = np.stack([heat_of(r, 256) for r in routes])
    cfg = PlannerConfig()
    still, acted = replace(cfg, refresh_drift=float("inf")), replace(cfg, hold_two_node_drift=False, drift_t=0.0)
    prev, held, laddered = None, 0, 0
    for t in range(1, 8):
        h = heats[:t + 1]
        call = drift_call(h, prev is not None, cfg, None, None, cl)
        w, moving = planning_forecast(h, prev, cfg, cl)
        raw, got = _plan(h, cl, prev, None, cfg), plan(h, cl, prev)
        assert not moving
        if call.held:
            held += 1
            assert call.backtest and planning_forecast(h, prev, acted, cl)[1]
            np.testing.assert_array_equal(w, planning_forecast(h, prev, still, cl)[0])
            np.testing.assert_array_equal(raw.phy2log, _plan(h, cl, prev, None, still).phy2log)
            want = replay_ladder(raw.phy2log, w, cl, h.sum(0), cfg.router)
            np.testing.assert_array_equal(got.phy2log, want)
            laddered += int((got.phy2log != raw.phy2log).any(1).sum())
            assert call.note().startswith(f"held: over {t - 1} scored windows the plain mean erred")
        prev = got
    assert held >= 3 and laddered >= 6


def test_only_two_nodes_with_spare_slots_and_no_tokens_hold_a_drift_call() -> None:
    """drift_call.holds: the backtest's call stands with routes, on four nodes, without a spare slot, under SGLang's
    dispatch (no replay steps) and with hold_two_node_drift off."""
    routes, _ = load_windows(TraceSpec(family="grouped", zipf_s=1.2, drift="fast", num_layers=4, windows=8, seed=0,
                                       window_tokens=2048))
    h = np.stack([heat_of(r, 256) for r in routes])
    cfg, two = PlannerConfig(), Cluster(16, 2, 288)
    call = drift_call(h, True, cfg, None, None, two)
    assert call.backtest and call.held and not call.moving
    assert drift_call(h, True, cfg, routes[-1], None, two).moving  # routes
    assert drift_call(h, True, cfg, None, None, Cluster(32, 4, 288)).moving  # four nodes
    assert drift_call(h, True, cfg, None, None, Cluster(16, 2, 256)).moving  # every slot one expert
    assert drift_call(h, True, planner_config("static"), None, None, two).moving
    assert drift_call(h, True, replace(cfg, hold_two_node_drift=False), None, None, two).moving
    assert drift_call(h, True, cfg).moving  # no cluster given
