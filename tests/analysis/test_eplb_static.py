"""SGLang's static dispatch replayed (r3trace/eplb/static.py) against the engine's ExpertMap, which runs it.

Contract, read from (not copied): compute_logical_to_rank_dispatch_physical_map in python/sglang/srt/eplb/
expert_location.py at sgl-project/sglang@01fec5c2e61f9568c41a6e1d4fd5ac46c88504f1: a rank with its own replica of
an expert sends there; the others are spread fairly over the replicas, which _compute_logical_to_all_physical_map
lists by ascending slot. The engine's static_choice (engine/layers/expert_map.py) is the deterministic spread the
analysis side must reproduce without importing the engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.engine.layers.expert_location import ExpertLocation
from r3trace.engine.layers.expert_map import static_choice
from r3trace.eplb import Cluster, global_policy, plan
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of
from r3trace.eplb.static import static_gpu_load, static_slots


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
    cl = Cluster(g, 2, p)
    assert np.array_equal(static_gpu_load(from_phy2log(phy, e), ids, cl, ranks), want)
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
    # planned placements on a skewed workload: static dispatch stays within a few points of the even split (a
    # replica serves its own rank plus a whole number of others), never above 1, and ours is not worse than
    # global's by more than that spread
    rng = np.random.default_rng(11)
    e, n_layers, t, k = 64, 3, 4000, 4
    w = 1.0 / np.arange(1, e + 1) ** 0.9
    ids = np.stack([np.stack([rng.choice(e, k, replace=False, p=w / w.sum()) for _ in range(n_layers)])
                    for _ in range(t)])
    heat = heat_of(ids, e)
    cl = Cluster(16, 2, 80)
    for pl in (plan(heat, cl, tokens=ids), global_policy(heat, cl)):
        even = balancedness(even_gpu_load(pl, heat, cl))
        stat = balancedness(static_gpu_load(pl, ids, cl))
        assert 0 < stat <= 1 and abs(stat - even) < 0.08, (stat, even)
