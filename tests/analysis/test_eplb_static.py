"""SGLang's static dispatch replayed (r3trace/eplb/static.py) against SGLang's own map and the engine's ExpertMap.

Contract, read from (not copied): compute_logical_to_rank_dispatch_physical_map and _find_nearest_expert in
python/sglang/srt/eplb/expert_location.py at character-tech/sglang@aa27354b1ae0325973baaa91c631ae03e2a0e341 (a fork
tracking upstream; the node rule is sgl-project/sglang PR #9849): a rank with its own replica of an expert sends
there; else, where its node holds some but not all replicas, to the node's first; the others are spread fairly over
all replicas, which _compute_logical_to_all_physical_map lists by ascending slot. Before PR #9849
(sgl-project/sglang@01fec5c2e61f9568c41a6e1d4fd5ac46c88504f1) there was no node rule. The engine's static_choice
(engine/layers/expert_map.py, one node) is the deterministic spread the analysis side must reproduce without
importing the engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.engine.layers.expert_location import ExpertLocation
from r3trace.engine.layers.expert_map import static_choice
from r3trace.eplb import Cluster, global_policy, plan
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of
from r3trace.eplb.static import dispatched_load, static_gpu_load, static_slots


def random_placement(rng: np.random.Generator, n_layers: int, e: int, p: int) -> np.ndarray:
    """[L, P] every expert once plus P - E extras drawn with a skew (some experts get several), slots shuffled."""
    rows = []
    for _ in range(n_layers):
        extra = rng.choice(e, p - e, p=np.arange(e, 0, -1) ** 2 / (np.arange(e, 0, -1) ** 2).sum())
        rows.append(rng.permutation(np.r_[np.arange(e), extra]))
    return np.stack(rows)


@pytest.mark.parametrize("e, p, g, seed", [(8, 12, 4, 0), (16, 24, 8, 1), (12, 12, 6, 2), (10, 30, 3, 3),
                                           (32, 40, 8, 4)])
def test_static_slots_match_engine(e: int, p: int, g: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    phy = random_placement(rng, 3, e, p)
    # log2phy in a scrambled replica order: the scorer must list replicas by slot, as SGLang's loader does
    pl = from_phy2log(phy, e)
    scrambled = pl._replace(log2phy=np.stack([np.stack([np.r_[rng.permutation(r[r >= 0]), r[r < 0]]
                                                        for r in layer]) for layer in pl.log2phy]))
    loc = ExpertLocation.from_physical_to_logical(phy, e, g, (0, 1, 2))
    got = static_slots(scrambled, Cluster(g, 1, p))
    for layer in range(3):
        for rank in range(g):
            assert got[layer, rank].tolist() == static_choice(loc, layer, rank).tolist()


def test_static_load_by_hand() -> None:
    # 4 GPUs, one slot each: expert 0 on GPUs 0, 1, 2; expert 1 on GPU 3. One token from each rank picks both.
    pl = from_phy2log(np.array([[0, 0, 0, 1]]), 2)
    ids = np.array([[[0, 1]]] * 4)  # [T=4, L=1, K=2]
    load = static_gpu_load(pl, ids, Cluster(4, 1, 4))
    # expert 0: ranks 0-2 keep their own; rank 3 (the first without one) takes replica (0 + 0) % 3 = slot 0.
    # expert 1: every rank sends to its one replica, GPU 3
    assert load.tolist() == [[2.0, 1.0, 1.0, 4.0]]
    ranks = np.array([3, 3, 3, 3])  # every token from rank 3: expert 0 all to GPU 0
    assert static_gpu_load(pl, ids, Cluster(4, 1, 4), ranks).tolist() == [[4.0, 0.0, 0.0, 4.0]]


def test_static_load_matches_pair_by_pair_loop() -> None:
    rng = np.random.default_rng(5)
    e, p, g, n_layers, k, t = 16, 24, 8, 2, 3, 50
    phy = random_placement(rng, n_layers, e, p)
    ids = np.stack([rng.choice(e, (n_layers, k), replace=False) for _ in range(t)])  # [T, L, K]
    ranks = rng.integers(0, g, t)
    loc = ExpertLocation.from_physical_to_logical(phy, e, g, tuple(range(n_layers)))
    want = np.zeros((n_layers, g))
    for layer in range(n_layers):
        maps = [static_choice(loc, layer, r).numpy() for r in range(g)]
        for i in range(t):
            for x in ids[i, layer]:
                want[layer, maps[ranks[i]][x] // (p // g)] += 1
    cl = Cluster(g, 2, p)  # the engine has no nodes: SGLang's rule before PR #9849
    assert np.array_equal(static_gpu_load(from_phy2log(phy, e), ids, cl, ranks, prefer_same_node=False), want)
    assert np.array_equal(static_gpu_load(from_phy2log(phy, e), ids, Cluster(g, 1, p), ranks), want)
    assert static_gpu_load(from_phy2log(phy, e), ids, cl, ranks).sum() == t * n_layers * k


def test_static_tracks_even_split_with_a_copy_per_rank() -> None:
    # every expert on every GPU (P = E x G): each rank keeps its own pairs, so the load is each rank's demand
    rng = np.random.default_rng(7)
    e, g = 8, 4
    phy = np.tile(np.arange(e), g)[None]
    ids = rng.integers(0, e, (400, 1, 1))
    load = static_gpu_load(from_phy2log(phy, e), ids, Cluster(g, 1, e * g))
    assert load.tolist() == [[100.0] * 4]  # 400 tokens, round robin over 4 ranks


def test_static_balancedness_near_even_on_planned_layouts() -> None:
    # planned placements on a skewed workload, one node (and two under SGLang's rule before PR #9849): a replica
    # serves whole ranks, so an expert with c replicas on G ranks gives one of them ceil(G / c) ranks where the even
    # split gives each G / c: no GPU carries more than the largest such ratio times its even-split load, and static
    # balancedness stays above the even split's over that ratio (less the tokens' sampling noise: 250 a rank), never
    # above 1. The node rule on the two nodes (a node's ranks to its first replica) gives 0.844 there, under the bound's
    # 0.863: the check tells the two rules apart.
    rng = np.random.default_rng(11)
    e, n_layers, t, k = 64, 3, 4000, 4
    w = 1.0 / np.arange(1, e + 1) ** 0.9
    ids = np.stack([np.stack([rng.choice(e, k, replace=False, p=w / w.sum()) for _ in range(n_layers)])
                    for _ in range(t)])
    heat = heat_of(ids, e)
    for cl, legacy in ((Cluster(16, 1, 80), False), (Cluster(16, 2, 80), True)):
        for pl in (plan(heat, cl, tokens=ids), global_policy(heat, cl)):
            even = balancedness(even_gpu_load(pl, heat, cl))
            stat = balancedness(static_gpu_load(pl, ids, cl, prefer_same_node=not legacy))
            c = np.asarray(pl.logcnt, dtype=np.float64)  # [L, E]
            ratio = float((np.ceil(cl.num_gpus / c) * c / cl.num_gpus).max())
            assert 0 < stat <= 1 and stat >= even / ratio - 0.02, (stat, even, ratio)


def test_node_rule_by_hand() -> None:
    # 2 nodes x 4 GPUs, one slot each: expert 0 on GPUs 0, 1 (node 0) and 4 (node 1); one token from each rank
    pl = from_phy2log(np.array([[0, 0, 1, 2, 0, 3, 4, 5]]), 6)
    ids = np.array([[[0]]] * 8)  # [T=8, L=1, K=1]
    cl = Cluster(8, 2, 8)
    # ranks 0, 1 keep their own; 2, 3 take node 0's first (GPU 0); 5-7 take node 1's only one (GPU 4)
    assert static_gpu_load(pl, ids, cl).tolist() == [[3.0, 1.0, 0, 0, 4.0, 0, 0, 0]]
    # before PR #9849: ranks 2, 3, 5, 6, 7 spread over the 3 replicas in turn, (i + 0) % 3
    assert static_gpu_load(pl, ids, cl, prefer_same_node=False).tolist() == [[3.0, 3.0, 0, 0, 2.0, 0, 0, 0]]


# SGLang's own map for one layer: 3 nodes x 2 GPUs x 3 slots, 10 experts, random.Random(42), computed by
# compute_logical_to_rank_dispatch_physical_map at character-tech/sglang@aa27354 (run beside this project, not
# committed). NEAR: 1 where the rank's choice came from _find_nearest_expert (one replica, own GPU, or the node's
# first where it narrows), 0 where from _fair_choices.
SGLANG_PHY2LOG = [0, 0, 1, 2, 0, 3, 4, 5, 0, 6, 1, 7, 8, 9, 2, 1, 3, 3]
SGLANG_MAP = [[0, 2, 3, 5, 6, 7, 9, 11, 12, 13], [4, 2, 3, 5, 6, 7, 9, 11, 12, 13],
              [8, 10, 14, 17, 6, 7, 9, 11, 12, 13], [8, 10, 3, 5, 6, 7, 9, 11, 12, 13],
              [0, 15, 14, 16, 6, 7, 9, 11, 12, 13], [8, 15, 14, 16, 6, 7, 9, 11, 12, 13]]
SGLANG_NEAR = [[1] * 10, [1] * 10, [1, 1, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1, 1, 1, 1, 1],
               [0, 1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]]


def test_static_slots_match_sglang_map() -> None:
    got = static_slots(from_phy2log(np.array([SGLANG_PHY2LOG]), 10), Cluster(6, 3, 18))[0]  # [G, E]
    want, near = np.array(SGLANG_MAP), np.array(SGLANG_NEAR, dtype=bool)
    assert np.array_equal(got[near], want[near])  # every nearest-replica choice, exactly
    for x in range(10):  # the fair spread: the same number of ranks on each replica (which one may differ)
        ranks = ~near[:, x]
        assert sorted(np.unique(got[ranks, x], return_counts=True)[1]) == \
            sorted(np.unique(want[ranks, x], return_counts=True)[1])


# SGLang's dynamic dispatch (ep_dispatch_algorithm="dynamic"): _compute_logical_to_all_physical_map at
# character-tech/sglang@aa27354 collapses a rank's candidate list for an expert to [_find_nearest_expert's pick]
# where there is one (SGLANG_NEAR above), else keeps all replicas; _topk_ids_logical_to_physical_dynamic
# (python/sglang/srt/eplb/expert_location_dispatch.py) then draws one of the rank's candidates per pair, uniformly
# (randint(0, 65536) % count: within 1 / 65536 of uniform). Expected per-GPU load of one pair from every rank:


def test_dynamic_expectation_matches_sglang_collapse() -> None:
    pl = from_phy2log(np.array([SGLANG_PHY2LOG]), 10)
    cl = Cluster(6, 3, 18)
    spg = 3
    want = np.zeros(6)
    for rank in range(6):
        for x in range(10):
            replicas = [s for s, v in enumerate(SGLANG_PHY2LOG) if v == x]
            cands = [SGLANG_MAP[rank][x]] if SGLANG_NEAR[rank][x] else replicas
            for s in cands:
                want[s // spg] += 1 / len(cands)
    got = dispatched_load(pl, np.ones((1, 6, 10)), cl, "dynamic")[0]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert not np.allclose(got, dispatched_load(pl, np.ones((1, 6, 10)), cl, "static")[0])  # the fair part differs


def test_dynamic_by_hand_and_token_replay() -> None:
    # test_node_rule_by_hand's layout: expert 0 on GPUs 0, 1 (node 0) and 4 (node 1), one token from each rank;
    # every rank has its own copy or its node's, so dynamic equals static there
    pl = from_phy2log(np.array([[0, 0, 1, 2, 0, 3, 4, 5]]), 6)
    ids = np.array([[[0]]] * 8)
    cl = Cluster(8, 2, 8)
    assert static_gpu_load(pl, ids, cl, dispatch="dynamic").tolist() == [[3.0, 1.0, 0, 0, 4.0, 0, 0, 0]]
    # without the node rule ranks 2, 3, 5, 6, 7 draw uniformly over the 3 replicas: 5 / 3 each on average
    got = static_gpu_load(pl, ids, cl, prefer_same_node=False, dispatch="dynamic")[0]
    np.testing.assert_allclose(got, [1 + 5 / 3, 1 + 5 / 3, 0, 0, 1 + 5 / 3, 0, 0, 0])
    # a token replay of random routes against a pair-by-pair loop of the rule
    rng = np.random.default_rng(7)
    e, g, p = 12, 6, 18
    ph = random_placement(rng, 2, e, p)
    pl, cl = from_phy2log(ph, e), Cluster(g, 3, p)
    ids = np.stack([np.stack([rng.choice(e, 3, replace=False) for _ in range(2)]) for _ in range(50)])
    want = np.zeros((2, g))
    for t in range(50):
        rank = t % g
        for layer in range(2):
            for x in ids[t, layer]:
                replicas = np.flatnonzero(ph[layer] == x)
                own = [s for s in replicas if s // 3 == rank]
                node = [s for s in replicas if s // 6 == rank // 2]
                cands = ([replicas[0]] if len(replicas) == 1 else [own[0]] if own else
                         [node[0]] if 0 < len(node) < len(replicas) else list(replicas))
                for s in cands:
                    want[layer, s // 3] += 1 / len(cands)
    np.testing.assert_allclose(static_gpu_load(pl, ids, cl, dispatch="dynamic"), want, rtol=1e-12)
