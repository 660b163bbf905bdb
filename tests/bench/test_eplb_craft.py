"""bench/eplb_craft.py: the CRAFT-style split of a replica budget over layers is the best split (brute force), and a
layer's levels add whole slots a GPU. Run: .venv/bin/pytest tests/bench/test_eplb_craft.py -q"""

from __future__ import annotations

import itertools

import numpy as np

from bench.eplb_craft import MAX_LEVEL, craft_levels, layer_balancedness
from r3trace.eplb import Cluster


def test_the_split_is_the_best_over_every_split() -> None:
    rng = np.random.default_rng(11)
    cl = Cluster(4, 2, 20, num_groups=1)
    skews = (0.2, 1.5, 0.8)  # layers unlike each other, so the split matters
    w = np.stack([rng.zipf(1 + s, 16).astype(float) * 10 + rng.random(16) for s in skews])
    for budget in (0, 2, 3, 5):
        got = craft_levels(w, cl, budget)
        assert got.sum() <= budget and got.max(initial=0) <= MAX_LEVEL
        est = [[layer_balancedness(w[i], cl, k, w[i]) for k in range(MAX_LEVEL + 1)] for i in range(len(w))]
        best = max(sum(est[i][k[i]] for i in range(len(w)))
                   for k in itertools.product(range(MAX_LEVEL + 1), repeat=len(w)) if sum(k) <= budget)
        assert abs(sum(est[i][got[i]] for i in range(len(w))) - best) < 1e-12
    assert (craft_levels(w, cl, 0) == 0).all()


def test_a_level_is_a_slot_on_every_gpu() -> None:
    w = np.array([50.0, 1, 1, 1, 1, 1, 1, 1])  # one hot expert on 4 GPUs: more replicas, better balance
    cl = Cluster(4, 1, 8, num_groups=1)
    b = [layer_balancedness(w, cl, k, w) for k in range(3)]  # 8, 12, 16 slots
    assert b[0] < b[1] < b[2]
    assert abs(b[0] - (57 / 4) / 51) < 1e-12  # the hot expert and the lightest on one GPU: max 51, mean 57 / 4
