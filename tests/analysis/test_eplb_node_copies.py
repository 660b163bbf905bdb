"""node_copies.py: where a node's slots hold every expert (P / N >= E) every node takes the same one-node plan, except
the layers whose newest hottest expert outweighs what one replica a node can carry. Run:
.venv/bin/pytest tests/analysis/test_eplb_node_copies.py -q"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from r3trace.eplb import Cluster, PlannerConfig, churn, plan
from r3trace.eplb.drift_call import holds
from r3trace.eplb.evaluate import planner_config
from r3trace.eplb.node_copies import copies_fit, copy_layers, node_slice
from r3trace.eplb.score import even_gpu_load, heat_of, node_limited

CL = Cluster(16, 2, 64, num_groups=4)  # the sample model's 16 / 2 / 64: 32 slots a node, E = 32
E, LAYERS, K = 32, 3, 4
ON = PlannerConfig()  # node copies on by default
OFF = replace(ON, node_copies=False)
ALL = replace(ON, copies_hot=float("inf"))


def _tokens(seed: int, hot: dict[int, float] | None = None, t: int = 4000) -> np.ndarray:
    """[T, L, K] top-K ids from a Zipf(0.3) over the experts (a shuffled order a layer); hot: layer -> the share of
    tokens that pick expert 0 first."""
    rng = np.random.default_rng(seed)
    out = np.empty((t, LAYERS, K), dtype=np.int64)
    for layer in range(LAYERS):
        p = 1.0 / np.arange(1, E + 1) ** 0.3
        p = p[rng.permutation(E)] / p.sum()
        for i in range(t):
            out[i, layer] = rng.choice(E, K, replace=False, p=p)
        if hot and layer in hot:
            pick = rng.random(t) < hot[layer]
            rows = out[pick, layer]
            rows[rows == 0] = rows[:, 0][(rows == 0).any(1)]  # expert 0 moved to the first pick, no duplicate
            rows[:, 0] = 0
            out[pick, layer] = rows
    return out


def _windows(seed: int, hot: dict[int, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """-> (loads [3, L, E] of three windows, the newest window's tokens)."""
    toks = [_tokens(seed + w, hot) for w in range(3)]
    return np.stack([heat_of(t, E) for t in toks]), toks[-1]


def _nodes(phy2log: np.ndarray) -> np.ndarray:
    return phy2log.reshape(len(phy2log), CL.num_nodes, CL.slots_per_node)  # [L, N, P / N]


def test_every_node_holds_the_one_node_plan_and_a_token_reaches_one_node() -> None:
    loads, toks = _windows(0)
    pl = plan(loads, CL, tokens=toks, cfg=ALL)
    one = plan(loads, node_slice(CL), tokens=toks, cfg=ALL)
    np.testing.assert_array_equal(pl.phy2log, np.tile(one.phy2log, (1, 2)))
    held = _tokens(7)
    d = node_limited(pl, held, CL)
    assert (d.nodes == 1).all()
    # each token takes one node (ties drawn), so node-limited dispatch is the even split up to that draw: 4,000 tokens
    # x 4 picks over 16 GPUs are ~1,000 units a GPU, the draw's sd ~sqrt(1,000 / 4) ~ 16 of them (1.6%); 6% is ~4 sd
    even = even_gpu_load(pl, heat_of(held, E), CL)
    assert np.abs(d.gpu_load - even).max() < 0.06 * even.mean()
    # the spread layout of the same windows spreads tokens over both nodes
    assert node_limited(plan(loads, CL, tokens=toks, cfg=OFF), held, CL).nodes.mean() > 1.2


def test_a_layer_whose_hot_expert_one_replica_a_node_cannot_carry_takes_the_spread_layout() -> None:
    loads, toks = _windows(1, hot={1: 0.6})  # expert 0 in 60% of layer 1's tokens: > 2,400 of 16,000 picks, > 2.4x a
    # GPU's mean over the 2 replicas of node copies (hottest x G / total = 2.0 > N = 2 at copies_hot 1.0 needs > 2)
    share = loads[-1, 1].max() * CL.num_gpus / loads[-1, 1].sum()
    assert share > 2.0 and (loads[-1, [0, 2]].max(1) * CL.num_gpus / loads[-1, [0, 2]].sum(1) < 2.0).all()
    np.testing.assert_array_equal(copy_layers(loads, None, CL), [True, False, True])
    pl = plan(loads, CL, tokens=toks, cfg=ON)
    nodes = _nodes(pl.phy2log)
    assert (nodes[[0, 2], 0] == nodes[[0, 2], 1]).all()
    assert pl.logcnt[1, 0] > 2  # spread: the hot expert split over more than one replica a node
    alone = plan(loads[:, 1:2], CL, tokens=toks[:, 1:2], cfg=OFF)  # the layer as the spread planner has it
    np.testing.assert_array_equal(pl.phy2log[1:2], alone.phy2log)
    # every layer copies at copies_hot = inf: the hot layer's max GPU load is then at least half the hot expert's
    forced = plan(loads, CL, tokens=toks, cfg=ALL)
    assert (forced.logcnt[1] == 2).all()
    w = loads[-1, 1]
    assert even_gpu_load(forced, loads[-1], CL)[1].max() >= w.max() / 2
    assert even_gpu_load(pl, loads[-1], CL)[1].max() < even_gpu_load(forced, loads[-1], CL)[1].max()


def test_a_replan_moves_the_same_replicas_on_every_node_within_the_churn_budget() -> None:
    loads, toks = _windows(2)
    prev = plan(loads[:2], CL, tokens=_tokens(20), cfg=ALL)
    out = plan(loads, CL, prev, tokens=toks, cfg=ALL)
    nodes = _nodes(out.phy2log)
    assert (nodes[:, 0] == nodes[:, 1]).all()
    sub = plan(loads, node_slice(CL), plan(loads[:2], node_slice(CL), tokens=_tokens(20), cfg=ALL), tokens=toks,
               cfg=ALL)
    np.testing.assert_array_equal(out.phy2log, np.tile(sub.phy2log, (1, 2)))
    assert churn(prev, out) <= 0.10


def test_a_previous_placement_that_is_no_copy_is_re_planned_in_the_spread_layout() -> None:
    loads, toks = _windows(3)
    spread = plan(loads[:2], CL, tokens=_tokens(30), cfg=OFF)  # the spread layout
    assert not copy_layers(loads, spread, CL).any()
    np.testing.assert_array_equal(plan(loads, CL, spread, tokens=toks, cfg=ON).phy2log,
                                  plan(loads, CL, spread, tokens=toks, cfg=OFF).phy2log)


@pytest.mark.parametrize(("cluster", "cfg", "fits"), [
    (CL, ON, True),
    (CL, OFF, False),
    (Cluster(16, 2, 48, num_groups=4), ON, False),  # 24 slots a node < 32 experts
    (Cluster(8, 1, 32, num_groups=4), ON, False),  # one node: nothing to copy
    (CL, replace(ON, keep_groups=True), False),
    (CL, replace(ON, spread_by_affinity=False), False),
    (CL, planner_config("static"), True),
])
def test_where_node_copies_apply(cluster: Cluster, cfg: PlannerConfig, fits: bool) -> None:
    assert copies_fit(cluster, E, cfg) is fits


def test_sglang_static_dispatch_plans_each_node_as_its_one_node_case() -> None:
    loads, toks = _windows(4)
    st = replace(planner_config("static"), copies_hot=float("inf"))
    np.testing.assert_array_equal(plan(loads, CL, tokens=toks, cfg=st).phy2log,
                                  np.tile(plan(loads, node_slice(CL), tokens=toks, cfg=st).phy2log, (1, 2)))


def test_the_hot_test_counts_the_replicas_a_node_gives_an_expert() -> None:
    """Expert 0 carries 12 of a layer's 43 units (31 others 1 each). At 32 slots a node (one replica each) its copy on
    each of 2 nodes carries 6, over 2x a GPU's mean of 43 / 16: spread. At 40 slots a node DeepSeek's rule gives it 8
    replicas a node (12 / 8 = 1.5 each until the cap of 8 GPUs), 0.75 a replica: copies, and the plan's nodes match."""
    w = np.ones((1, E))
    w[0, 0] = 12.0
    np.testing.assert_array_equal(copy_layers(w, None, CL), [False])
    wide = Cluster(16, 2, 80, num_groups=4)
    np.testing.assert_array_equal(copy_layers(w, None, wide), [True])
    pl = plan(w, wide, cfg=ON)
    halves = pl.phy2log.reshape(1, 2, 40)
    np.testing.assert_array_equal(halves[:, 0], halves[:, 1])
    assert pl.logcnt[0, 0] == 16  # 8 a node


def test_a_drift_call_without_routes_is_not_held_where_nodes_copy() -> None:
    """drift_call.holds: the two-node hold of a heat-only drift call is the spread layout's; copies plan on one node's
    slice, where the call acts, and `r3trace eplb`'s re-plan line reads the same call."""
    assert not holds(CL, E, ON)
    assert holds(CL, E, OFF)
    assert holds(Cluster(16, 2, 48, num_groups=4), E, ON)  # 24 slots a node: no copies, the spread layout's hold
