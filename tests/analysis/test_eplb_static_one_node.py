"""One node planned for SGLang's static dispatch (r3trace/eplb/static_one_node.py): replica counts that divide the
GPUs, each expert's replicas on distinct GPUs, so static dispatch (static.py, the fair spread of the ranks without a
replica) splits every expert's load evenly; held out it beats ours' node-limited plan and DeepSeek's global policy
under that dispatcher, and re-plans of an unchanged workload stay within the churn goal."""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster, churn, global_policy, plan
from r3trace.eplb.evaluate import planner_config
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of
from r3trace.eplb.static import static_expected_load, static_gpu_load
from r3trace.eplb.static_one_node import divisor_counts, static_one_node
from tests.analysis.test_eplb_static_spread import skewed


def test_divisor_counts_by_hand() -> None:
    # 8 GPUs: 3 -> 2 and 7 -> 4 free 1 + 3 slots; upgrades by load per replica (15, 5, 4, 10): expert 0 2 -> 4
    # (cost 2), then expert 3's 4 -> 8 costs 4 > the 2 left, so experts 1 and 2 1 -> 2
    got = divisor_counts(np.array([3, 1, 1, 7]), np.array([30.0, 5.0, 4.0, 40.0]), 8)
    assert got.tolist() == [4, 2, 2, 4]
    # one slot left and no upgrade of cost 1 (every count 2 or 4): a single extra replica to the highest load per
    # replica (30 / 4), the one uneven case
    got = divisor_counts(np.array([2, 4, 3]), np.array([10.0, 30.0, 9.0]), 8)
    assert got.tolist() == [2, 5, 2]
    assert divisor_counts(np.array([5, 1]), np.array([50.0, 1.0]), 8).tolist() == [4, 2]


@pytest.mark.parametrize("g, p, seed", [(8, 288, 0), (8, 320, 1), (4, 80, 2), (6, 96, 3)])
def test_static_dispatch_is_the_even_split(g: int, p: int, seed: int) -> None:
    e = 256 if p >= 256 else 64
    ids = skewed(seed, e, 3, 3000, 6, 1.2)
    heat = heat_of(ids, e)
    cl = Cluster(g, 1, p)
    ph = static_one_node(global_policy(heat, cl).phy2log, heat, cl)  # DeepSeek's counts: 3, 5, 6, 7 among them
    counts = np.stack([np.bincount(row, minlength=e) for row in ph])
    assert (g % counts == 0).all()
    on = np.zeros((len(ph), e, g), dtype=np.int64)
    for layer, row in enumerate(ph):
        np.add.at(on[layer], (row, np.arange(p) // (p // g)), 1)
    assert on.max() == 1  # distinct GPUs
    pl = from_phy2log(ph, e)
    np.testing.assert_allclose(static_expected_load(ph, heat, cl), even_gpu_load(pl, heat, cl), rtol=1e-12)
    # DeepSeek's layout had counts that do not divide G, and static dispatch split them unevenly
    before = global_policy(heat, cl)
    assert (g % before.logcnt != 0).any()
    assert not np.allclose(static_expected_load(before.phy2log, heat, cl), even_gpu_load(before, heat, cl))


def test_plan_for_static_dispatch_on_one_node_beats_node_limited_plan_and_global_held_out() -> None:
    e, cl = 256, Cluster(8, 1, 288)
    ids = skewed(7, e, 3, 8000, 8, 1.2)
    train, held = ids[:4000], ids[4000:]
    heat = heat_of(train, e)
    score = {name: balancedness(static_gpu_load(pl, held, cl)) for name, pl in (
        ("static", plan(heat, cl, tokens=train, cfg=planner_config("static"))),
        ("node-limited", plan(heat, cl, tokens=train)), ("global", global_policy(heat, cl)))}
    assert score["static"] > max(score["node-limited"], score["global"]) + 0.01, score


@pytest.mark.parametrize("s", [0.6, 1.2])
def test_few_spare_slots_on_many_gpus_keep_the_plans_counts(s: float) -> None:
    # 16 GPUs / 80 slots, 64 experts: rounding the counts to divisors of 16 gives up replicas the 16 spare slots held,
    # and the plan's own layout has the lower forecast max GPU load under static dispatch (keep_lower keeps it);
    # held out under static dispatch that is +0.064 / +0.045 over the divisor layouts and above DeepSeek global
    e, cl = 64, Cluster(16, 1, 80)
    ids = skewed(0, e, 3, 8000, 4, s)
    train, held = ids[:4000], ids[4000:]
    heat = heat_of(train, e)
    default = plan(heat, cl, tokens=train)
    divided = from_phy2log(static_one_node(default.phy2log, heat.astype(np.float64), cl), e)
    score = {name: balancedness(static_gpu_load(pl, held, cl)) for name, pl in (
        ("static", plan(heat, cl, tokens=train, cfg=planner_config("static"))), ("divided", divided),
        ("global", global_policy(heat, cl)))}
    assert score["static"] > max(score["divided"] + 0.03, score["global"]), score


def test_unchanged_workload_replans_within_the_budget() -> None:
    e = 64
    routes = skewed(9, e, 3, 8 * 2048, 6, 1.0).reshape(8, 2048, 3, 6)
    heats = np.stack([heat_of(w, e) for w in routes])
    cl, cfg = Cluster(8, 1, 96), planner_config("static")
    prev, moved = None, []
    for t in range(1, len(routes)):
        pl = plan(heats[:t + 1], cl, prev, tokens=routes[t], cfg=cfg)
        assert (8 % pl.logcnt == 0).all()
        if prev is not None:
            moved.append(churn(prev, pl))
        prev = pl
    assert max(moved) <= 0.10, moved
