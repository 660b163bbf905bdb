"""node_swaps (experts swapped between nodes for fewer expected nodes per token, P = E without tokens): each round's
swap against a brute-force search over every pair scored by node_model.expected_nodes itself, the GPU-load cap, and
held out on tokens of a grouped router that the plan never saw. Run:
.venv/bin/pytest tests/analysis/test_eplb_node_swaps.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from bench.eplb_traces import TraceSpec, synth_windows
from r3trace.eplb import Cluster, PlacementError, PlannerConfig, plan
from r3trace.eplb.candidates import nodes_per_token
from r3trace.eplb.deepseek import global_phy2log
from r3trace.eplb.node_model import expected_nodes
from r3trace.eplb.node_swaps import node_swaps
from r3trace.eplb.planner import planning_forecast
from r3trace.eplb.score import phy2log_gpu_load


def brute_best_swap(ph: np.ndarray, w: np.ndarray, cl: Cluster, k: int, tg: int, cap: float) -> tuple[float, float]:
    """-> (the layer's expected nodes, the best over every feasible single swap of two slots on different nodes)."""
    base = expected_nodes(ph[None], w[None], cl, k, tg)[0]
    load = phy2log_gpu_load(ph[None], w[None], cl)[0]
    top, limit = load.argmax(), cap * load.max()
    gpu, node = cl.slot_gpu(), cl.slot_node()
    best = base
    for a in range(cl.num_slots):
        for b in range(a + 1, cl.num_slots):
            if node[a] == node[b] or top in (gpu[a], gpu[b]):
                continue
            d = w[ph[b]] - w[ph[a]]
            if load[gpu[a]] + d > limit or load[gpu[b]] - d > limit:
                continue
            t = ph.copy()
            t[a], t[b] = t[b], t[a]
            best = min(best, expected_nodes(t[None], w[None], cl, k, tg)[0])
    return base, best


@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("groups", [3, 1])
@pytest.mark.parametrize("seed", range(4))
def test_one_round_is_the_best_swap(seed: int, groups: int, nodes: int) -> None:
    """Two or three nodes: no two node pairs are disjoint, so a round is one swap, the best one. Odd shape: 18
    experts in 3 groups of 6 (the best swaps here are across groups) or in one group (every swap within a group: its
    own formula) on 6 GPUs of 3 slots."""
    rng = np.random.default_rng(seed)
    cl, k, tg = Cluster(6, nodes, 18, num_groups=groups), 4, min(2, groups)
    w = rng.gamma(0.6, size=18) * 100
    ph = rng.permutation(18)
    base, best = brute_best_swap(ph, w, cl, k, tg, 0.9)
    got = node_swaps(ph[None], w[None], cl, k, tg, 0.9, max_rounds=1, pair_swaps=1, candidates=18)
    after = expected_nodes(got, w[None], cl, k, tg)[0]
    assert best < base - 1e-3  # a swap that gains exists on these seeds
    # float32 gains: the chosen swap is the best within 1e-6 of the layer's nodes per token
    assert after == pytest.approx(best, abs=1e-6)
    assert sorted(got[0]) == list(range(18))


@pytest.mark.parametrize("seed", range(3))
def test_swaps_inside_a_pair_are_rounds(seed: int) -> None:
    """On two nodes a round's swaps inside its one node pair are what further rounds would do: one round of 4 swaps
    gives the layout of 4 rounds of one."""
    rng = np.random.default_rng(10 + seed)
    cl = Cluster(6, 2, 18, num_groups=3)
    w = rng.gamma(0.6, size=(2, 18)) * 100
    ph = np.stack([rng.permutation(18) for _ in range(2)])
    inside = node_swaps(ph, w, cl, 4, 2, 0.9, max_rounds=1, pair_swaps=4, candidates=18)
    rounds = node_swaps(ph, w, cl, 4, 2, 0.9, max_rounds=4, pair_swaps=1, candidates=18)
    np.testing.assert_array_equal(inside, rounds)
    assert (inside != ph).sum(1).max() >= 6  # 3 or more swaps in a layer: the inner swaps ran


@pytest.mark.parametrize("seed", range(3))
def test_cap_and_max_gpu(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cl = Cluster(32, 4, 64, num_groups=8)
    w = rng.gamma(0.5, size=(3, 64)) * 10
    ph = global_phy2log(w, cl)
    got = node_swaps(ph, w, cl, 8, 0, 0.5)
    before, after = phy2log_gpu_load(ph, w, cl), phy2log_gpu_load(got, w, cl)
    top = before.argmax(1)
    for i in range(3):
        assert sorted(got[i]) == list(range(64))
        g = top[i]
        assert (got[i, 2 * g:2 * g + 2] == ph[i, 2 * g:2 * g + 2]).all()  # the max GPU untouched
        moved = (after[i] != before[i]) & (np.arange(32) != g)
        assert (after[i][moved] <= 0.5 * before[i].max() * (1 + 1e-12)).all()
    assert after.max(1) == pytest.approx(before.max(1), rel=1e-12)
    lo, hi = expected_nodes(got, w, cl, 8, 0), expected_nodes(ph, w, cl, 8, 0)
    assert (lo <= hi).all() and (lo < hi - 0.05).any()
    np.testing.assert_array_equal(node_swaps(ph, w, cl, 8, 0, 0.0), ph)  # off


def test_fewer_nodes_held_out() -> None:
    """A grouped router (bench/eplb_traces.py, s = 1.2): a layout swapped on window 0's loads is scored on window
    1's tokens, which it never saw. Against DeepSeek global's layout on the same loads: fewer nodes per token, the
    same max GPU load on window 1."""
    spec = TraceSpec(family="grouped", zipf_s=1.2, num_layers=2, windows=2, window_tokens=4096, seed=5)
    routes = synth_windows(spec).astype(np.int64)  # [2, T, L, K]
    cl = Cluster(64, 8, 256, num_groups=8)
    heat = np.stack([np.stack([np.bincount(r[:, li].ravel(), minlength=256) for li in range(2)]) for r in routes])
    w = heat[0].astype(np.float64)
    glob = global_phy2log(w, cl)
    got = node_swaps(glob, w, cl, 8, 0, 0.4)
    g_nodes, s_nodes = nodes_per_token(glob, routes[1], cl), nodes_per_token(got, routes[1], cl)
    assert (s_nodes < g_nodes - 0.2).all(), (s_nodes, g_nodes)
    np.testing.assert_allclose(phy2log_gpu_load(got, heat[1], cl).max(1), phy2log_gpu_load(glob, heat[1], cl).max(1))


def test_plan_without_tokens() -> None:
    """The planner swaps where no token reaches it (P = E, an SGLang dump) and not where tokens do."""
    spec = TraceSpec(family="grouped", zipf_s=1.2, num_layers=2, windows=1, window_tokens=2048, seed=2)
    routes = synth_windows(spec)[0]
    cl = Cluster(128, 16, 256, num_groups=8)
    heat = np.stack([np.bincount(routes[:, li].ravel().astype(np.int64), minlength=256) for li in range(2)])
    loads = heat[None].astype(np.float64)
    on, off = plan(loads, cl), plan(loads, cl, cfg=PlannerConfig(node_swap_cap=0.0))
    w = loads[0]
    lo, hi = expected_nodes(on.phy2log, w, cl, 8, 0), expected_nodes(off.phy2log, w, cl, 8, 0)
    assert (lo < hi - 0.3).all(), (lo, hi)
    tok_on, tok_off = plan(loads, cl, tokens=routes), plan(loads, cl, tokens=routes,
                                                          cfg=PlannerConfig(node_swap_cap=0.0))
    np.testing.assert_array_equal(tok_on.phy2log, tok_off.phy2log)


def test_still_replan_swaps_a_few() -> None:
    """A still re-plan without tokens takes one round of swaps saving > replan_swap_gain each: at most N / 2 swaps a
    layer beyond the re-plan without them, never more expected nodes per token, the same max GPU load."""
    spec = TraceSpec(family="grouped", zipf_s=1.2, num_layers=3, windows=4, window_tokens=2048, seed=4)
    routes = synth_windows(spec).astype(np.int64)
    cl = Cluster(128, 16, 256, num_groups=8)
    heat = np.stack([np.stack([np.bincount(r[:, li].ravel(), minlength=256) for li in range(3)]) for r in routes])
    loads = heat.astype(np.float64)
    off_cfg = PlannerConfig(replan_swap_gain=0.0)
    first = plan(loads[:2], cl, cfg=off_cfg)
    on, off = plan(loads[:3], cl, first), plan(loads[:3], cl, first, cfg=off_cfg)
    w, moving = planning_forecast(loads[:3], first, PlannerConfig(), cl)  # the plans' forecast
    assert not moving  # a still re-plan
    extra = (on.phy2log != off.phy2log).sum(1)
    assert extra.max() <= 2 * cl.num_nodes // 2 and extra.sum() > 0, extra
    lo, hi = expected_nodes(on.phy2log, w, cl, 8, 0), expected_nodes(off.phy2log, w, cl, 8, 0)
    assert (lo <= hi + 1e-12).all() and (lo < hi - 0.005).any(), (lo, hi)
    np.testing.assert_allclose(phy2log_gpu_load(on.phy2log, w, cl).max(1), phy2log_gpu_load(off.phy2log, w, cl).max(1))


def test_cap_validated() -> None:
    with pytest.raises(PlacementError, match="node_swap_cap=1"):
        PlannerConfig(node_swap_cap=1.0)
