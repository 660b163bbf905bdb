"""Re-plans of a drifting workload (forecast.drifts, replan.refreshed) and the per-layer layout choice
(candidates.py). Run: .venv/bin/pytest tests/analysis/test_eplb_refresh.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster, PlannerConfig, churn, from_phy2log, global_policy, plan
from r3trace.eplb.candidates import MAX_LOAD_TIE, best_layout, by_group, nodes_per_token
from r3trace.eplb.forecast import backtest_errors, drifts, forecast
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of, node_limited

E, K, L = 64, 6, 3
NO_REFRESH = PlannerConfig(refresh_drift=1e9)  # the budgeted re-plan alone


def _windows(sigma: float, windows: int = 7, tokens: int = 4096, seed: int = 7) -> np.ndarray:
    """[W, T, L, K] routes: Zipf(1) popularity per layer plus a random walk of `sigma` logits a window (0: one
    unchanged router), K distinct experts per token by Gumbel top-k."""
    rng = np.random.default_rng(seed)
    base = -np.log1p(np.argsort(rng.random((L, E)), axis=1))  # [L, E]
    walk = np.zeros((L, E))
    out = np.empty((windows, tokens, L, K), dtype=np.int64)
    for w in range(windows):
        logits = base + walk + rng.gumbel(size=(tokens, L, E))  # [T, L, E]
        out[w] = np.argpartition(-logits, K, axis=2)[..., :K]
        walk += rng.normal(0, sigma, walk.shape)
    return out


def _heats(routes: np.ndarray) -> np.ndarray:
    return np.stack([heat_of(w, E) for w in routes])


def test_drift_is_called_on_a_random_walk_only_and_never_on_one_backtest_window() -> None:
    still, walk = _heats(_windows(0.0)), _heats(_windows(0.5))
    assert not any(drifts(still[:t], backtest_errors(still[:t]), 0.1) for t in range(3, 8))
    assert all(drifts(walk[:t], backtest_errors(walk[:t]), 0.1) for t in range(4, 8))
    # one backtest window (3 windows seen) is too few to call drift, however far it moved
    assert not drifts(walk[:3], backtest_errors(walk[:3]), 0.1)
    assert not drifts(walk[:5], None, 0.1)  # a fixed EMA weight: no backtest, no drift


def _rolling(routes: np.ndarray, cl: Cluster, cfg: PlannerConfig) -> tuple[list[float], list[float]]:
    """Plan at the end of window t from the windows seen (from the previous plan), score on t + 1 -> (churn per
    re-plan, held-out balancedness per re-plan); the cold start (t = 1) is not scored."""
    heats = _heats(routes)
    prev, moved, held = None, [], []
    for t in range(1, len(routes) - 1):
        pl = plan(heats[:t + 1], cl, prev, tokens=routes[t], cfg=cfg)
        if prev is not None:
            moved.append(churn(prev, pl))
            held.append(balancedness(even_gpu_load(pl, heats[t + 1], cl)))
            w = forecast(heats[:t + 1], None)
            low = plan(heats[:t + 1], cl, prev, tokens=routes[t], cfg=NO_REFRESH)
            # a refresh never raises the budgeted re-plan's forecast max GPU load (averaged over layers)
            assert even_gpu_load(pl, w, cl).max(1).mean() <= even_gpu_load(low, w, cl).max(1).mean() + 1e-9
        prev = pl
    return moved, held


def test_unchanged_workload_replans_within_the_budget_and_a_drifting_one_refreshes() -> None:
    cl = Cluster(16, 4, 80, num_groups=8)
    still = _windows(0.0, windows=9, seed=8)
    moved, held = _rolling(still, cl, PlannerConfig())
    assert max(moved) <= 0.10  # the goal for an unchanged workload: <= 10% of slots a re-plan
    assert (moved, held) == _rolling(still, cl, NO_REFRESH)  # measured: 0.02-0.06 of slots, as without refresh
    walk = _windows(0.5, windows=9, seed=8)
    moved, held = _rolling(walk, cl, PlannerConfig())
    _, budgeted = _rolling(walk, cl, NO_REFRESH)
    # measured: 0.09 of slots on the first re-plan (one backtest window), then 0.77-0.79; held out 0.731 against
    # 0.679 for the budgeted re-plans (global on the newest window: 0.723)
    assert max(moved) > 0.5
    assert np.mean(held) >= np.mean(budgeted) + 0.03


def test_nodes_per_token_without_replicas_is_the_dispatchers_cover() -> None:
    # one replica per expert: the fewest covering nodes (score.node_limited's exact cover, N <= 8) are exactly
    # the distinct nodes of the token's experts
    routes = _windows(0.0, windows=1, tokens=512)[0]
    cl = Cluster(32, 8, E, num_groups=8)
    pl = global_policy(heat_of(routes, E), cl)
    np.testing.assert_allclose(nodes_per_token(pl.phy2log, routes, cl), node_limited(pl, routes, cl).nodes.mean(0))


@pytest.mark.parametrize("gpus,nodes,experts", [(72, 9, 72), (64, 16, 64), (64, 64, 64), (128, 128, 128)])
def test_nodes_per_token_counts_each_tokens_distinct_nodes(gpus: int, nodes: int, experts: int) -> None:
    # node bits ORed per token against a set per token: 9 and 16 nodes in 16-bit masks, 64 in all 64 bits, 128 by a sort
    rng = np.random.default_rng(nodes)
    routes = rng.integers(0, experts, (256, L, K))  # [T, L, K]
    cl = Cluster(gpus, nodes, experts)
    ph = np.stack([rng.permutation(experts) for _ in range(L)])  # [L, P]
    node = cl.slot_node()[np.argsort(ph, axis=1)]  # [L, E] node of each expert
    want = [np.mean([len({int(node[layer, x]) for x in t}) for t in routes[:, layer]]) for layer in range(L)]
    np.testing.assert_array_equal(nodes_per_token(ph, routes, cl), want)


def test_best_layout_keeps_global_unless_a_tied_candidate_wins_past_the_noise() -> None:
    """Every layout ties on the max load (equal loads, P = E). Layer 0's tokens pick experts independently, so no
    candidate's nodes per token differ from global's but by noise: global's own layer is kept. Layer 1's tokens stay
    within ours' nodes: ours touches 1 node a token against global's ~3, and replaces it."""
    cl = Cluster(16, 4, 32)
    rng = np.random.default_rng(1)  # a seed where the fewest nodes per token on the newer half are not global's
    w = np.ones((2, 32))
    ours = np.stack([rng.permutation(32) for _ in range(2)])
    node_experts = ours[1].reshape(4, 8)  # ours' 4 nodes, 8 experts each
    t = 2048
    independent = np.stack([rng.choice(32, 4, replace=False) for _ in range(t)])
    local = np.stack([rng.choice(node_experts[rng.integers(4)], 4, replace=False) for _ in range(t)])
    tokens = np.stack([independent, local], 1)  # [T, 2, 4]
    got = best_layout(ours, w, cl, tokens)
    glob = global_policy(w, cl).phy2log
    np.testing.assert_array_equal(got[0], glob[0])
    assert nodes_per_token(got, tokens, cl)[1] == pytest.approx(1.0)
    assert nodes_per_token(glob, tokens, cl)[1] > 2.5


def test_best_layout_is_as_balanced_as_the_best_candidate_and_touches_fewest_nodes_among_the_tied() -> None:
    routes = _windows(0.0, windows=2, tokens=2048, seed=3)
    cl = Cluster(32, 16, E, num_groups=8)  # no spare slot, 2 slots a GPU, 4 a node
    w = heat_of(routes[0], E)
    ours = plan(w, cl, tokens=routes[0], cfg=PlannerConfig(polish_steps=0))
    glob = global_policy(w, cl).phy2log
    grouped = by_group(glob, E, cl)
    # reordering whole GPUs keeps every GPU's load
    np.testing.assert_allclose(np.sort(even_gpu_load(from_phy2log(grouped, E), w, cl)),
                               np.sort(even_gpu_load(global_policy(w, cl), w, cl)))
    got = best_layout(ours.phy2log, w, cl, routes[0])
    cands = np.stack([ours.phy2log, grouped, glob])
    peak = np.stack([even_gpu_load(from_phy2log(c, E), w, cl).max(1) for c in cands])
    got_peak = even_gpu_load(from_phy2log(got, E), w, cl).max(1)
    assert (got_peak <= peak.min(0) * (1 + MAX_LOAD_TIE)).all()
    nodes = np.stack([nodes_per_token(c, routes[0], cl) for c in cands])
    tied = peak <= peak.min(0) * (1 + MAX_LOAD_TIE)
    np.testing.assert_allclose(nodes_per_token(got, routes[0], cl), np.where(tied, nodes, np.inf).min(0))

