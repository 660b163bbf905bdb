"""Two nodes with tokens (r3trace/eplb/static_ladder.token_ladder): the static-even ladder on the layers whose
node-limited replay is skewed, scored by that replay of the newest tokens, against the same choice made by replaying
every rung as a whole layout, and the planner's use of it (fresh plans whole, still re-plans within the churn budget,
drifting re-plans left to the replay contest).

Run: .venv/bin/pytest -q tests/analysis/test_eplb_token_ladder.py
"""

from __future__ import annotations

import numpy as np

from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, PlannerConfig, churn, plan
from r3trace.eplb.deepseek import global_phy2log
from r3trace.eplb.dispatch_contest import replay_guard
from r3trace.eplb.planner import _plan, planning_forecast
from r3trace.eplb.replay_max import node_limited_replay
from r3trace.eplb.score import heat_of, phy2log_gpu_load
from r3trace.eplb.static_ladder import CHOICE_TOKENS, NODE_MARGIN, SKEW, _ladder, choose, token_ladder

CL = Cluster(16, 2, 288)
E, K = 256, 8


def _windows(windows: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """[W, L, E] heat and routes of bench/eplb_traces.py's clustered router (s = 1.2, slow drift, 4 layers, 2,048
    tokens a window, trace seed 1): its co-located domains skew node-limited dispatch on ours' layout."""
    spec = TraceSpec(family="clustered", zipf_s=1.2, drift="slow", num_layers=4, windows=windows, window_tokens=2048,
                     seed=1)
    routes, _ = load_windows(spec)
    return np.stack([heat_of(r, E) for r in routes]), routes


def test_token_ladder_climbs_the_skewed_layers_as_replaying_every_rung_whole_does() -> None:
    # the fresh plan on 4 windows: layers 0-2 replay 1.03-1.07x the even split's max GPU load on the same tokens,
    # layer 3 under it (under SKEW: left as it is); the ladder scores only a layer's distinct rungs, packed into
    # shared layouts, and replaying each rung of the skewed layers as a whole layout must choose the same
    heats, routes = _windows(4)
    w, tokens, mean_loads = heats[-1], routes[-1], heats.sum(0)
    phy = _plan(heats, CL, None, tokens, PlannerConfig()).phy2log
    tok = tokens[-CHOICE_TOKENS:]
    glob = global_phy2log(mean_loads, CL)
    (top, _), (mine, theirs) = node_limited_replay([phy, glob], E, tok, CL)  # [L] each
    skewed = top > phy2log_gpu_load(phy, heat_of(tok, E), CL).max(1) * (1 + SKEW)
    assert skewed.tolist() == [True, True, True, False]
    rows = np.flatnonzero(skewed)
    ladder = _ladder(phy[rows], w[rows], CL)  # [V, R, P]
    peak, nodes = node_limited_replay(list(ladder), E, tok[:, rows], CL)  # [V, R]
    bal = (len(tok) * K / CL.num_gpus) / peak
    # the whole plan's nodes per token within global's less the margin: layer 3 keeps its own
    budget = float(theirs.sum()) * (1 - NODE_MARGIN) - float(mine[3])
    pick = choose(bal, nodes, budget)
    want = phy.copy()
    want[rows] = ladder[pick, np.arange(len(rows))]
    got = token_ladder(phy, w, CL, tokens, mean_loads)
    np.testing.assert_array_equal(got, want)
    assert (got != phy).any(1).tolist() == [False, True, True, False]  # layer 0's rungs overrun the nodes
    taken = pick[pick > 0]
    assert nodes[pick, np.arange(len(rows))].sum() <= budget + 1e-9
    assert (bal[taken, np.flatnonzero(pick > 0)] > bal[0, pick > 0] * 1.01).all()
    # a re-plan's budget (prev, churn): the climbed layers biggest replayed gain first while their moved slots fit
    gain = bal[pick, np.arange(len(rows))] / bal[0]  # [R]
    first, second = rows[np.argsort(-gain, kind="stable")[:2]]
    moved = (got != phy).sum(1)  # [L] slots each climbed layer moves
    budget = max(moved[first], moved[second]) + 0.5  # either alone fits, not both: the order decides
    tight = token_ladder(phy, w, CL, tokens, mean_loads, phy, budget / phy.size)
    assert (tight != phy).any(1).tolist() == [layer == first for layer in range(4)]


def test_the_planner_ladders_fresh_plans_and_still_replans_within_their_budget() -> None:
    heats, routes = _windows(10)
    cfg = PlannerConfig()
    prev, laddered = None, 0
    for t in range(1, 9):
        h, tokens = heats[max(0, t - 7):t + 1], routes[t]
        w, moving = planning_forecast(h, prev, cfg, CL)
        raw = _plan(h, CL, prev, tokens, cfg).phy2log
        got = plan(h, CL, prev, tokens=tokens)
        assert not moving  # slow drift: fresh and still plans (a drifting one is contested, drift_replay)
        if prev is None:
            want = token_ladder(raw, w, CL, tokens, h.sum(0))
            laddered += int((want != raw).any(1).sum())
        else:
            guarded = replay_guard(raw, prev.phy2log, CL, tokens, cfg.replay_margin)
            want = token_ladder(guarded, w, CL, tokens, h.sum(0), prev.phy2log, cfg.seeded_churn_budget)
            assert churn(prev, got) <= cfg.seeded_churn_budget
            laddered += int((want != guarded).any(1).sum())
        np.testing.assert_array_equal(got.phy2log, want)
        prev = got
    assert laddered >= 3
    off = PlannerConfig(replay_margin=-1.0)  # the replay steps off: no ladder either
    np.testing.assert_array_equal(plan(heats[:2], CL, tokens=routes[1], cfg=off).phy2log,
                                  _plan(heats[:2], CL, None, routes[1], off).phy2log)
