"""EPLB scores on hand-computed unbalanced inputs: balancedness, per-GPU load (even split and node-limited
dispatch), nodes per token and churn. Every expected number is worked out in the comments.

Run: .venv/bin/pytest tests/analysis/test_eplb_scores.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster, churn, from_phy2log
from r3trace.eplb.score import balancedness, even_gpu_load, node_limited, phy2log_gpu_load


def test_balancedness_is_the_mean_over_layers_of_mean_over_max() -> None:
    """DeepSeek's EPLB README (github.com/deepseek-ai/EPLB, README.md at d52c72d5) asks for balanced GPU loads
    but defines no number; SGLang's "[Expert Balancedness]" log line is, per layer, mean / max GPU load
    ((mean + 1e-5) / (max + 1e-5)), averaged over layers (python/sglang/srt/eplb/expert_distribution.py at
    dd780ab9, compute_utilization_rate and _append_utilization_rate). Ours is the same without the 1e-5.
    On this input every other reading of "balancedness" gives another number, so the test pins this one."""
    load = np.array([[4.0, 2.0, 1.0, 1.0],  # mean 2, max 4: 0.5 (max/mean 2)
                     [3.0, 3.0, 3.0, 3.0]])  # 1.0
    expected = (0.5 + 1.0) / 2
    others = {
        "1 / mean of max/mean": 1 / ((2.0 + 1.0) / 2),  # 0.667
        "mean of all / max of all": 2.5 / 4.0,  # 0.625
        "mean of means / mean of maxes": 2.5 / 3.5,  # 0.714
        "worst layer": 0.5,
    }
    assert all(abs(v - expected) > 0.03 for v in others.values())
    assert balancedness(load) == pytest.approx(expected, abs=1e-12)
    sglang = ((load.mean(1) + 1e-5) / (load.max(1) + 1e-5)).mean()
    assert balancedness(load) == pytest.approx(sglang, abs=1e-5)


def test_even_gpu_load_splits_each_expert_over_its_replicas() -> None:
    # 2 GPUs x 2 slots. Layer 0: heat [9, 4, 1], expert 0 twice -> slots [4.5, 4, | 4.5, 1] -> GPUs [8.5, 5.5].
    # Layer 1: heat [2, 6, 4], expert 1 twice on slots 0 and 3 -> slots [3, 4, | 2, 3] -> GPUs [7, 5].
    pl = from_phy2log(np.array([[0, 1, 0, 2], [1, 2, 0, 1]]), 3)
    cl = Cluster(num_gpus=2, num_nodes=1, num_slots=4, num_groups=1)
    load = even_gpu_load(pl, np.array([[9.0, 4.0, 1.0], [2.0, 6.0, 4.0]]), cl)
    np.testing.assert_array_equal(load, [[8.5, 5.5], [7.0, 5.0]])
    assert balancedness(load) == pytest.approx((7 / 8.5 + 6 / 7) / 2, abs=1e-12)  # 100/119 = 0.8403


def test_node_limited_dispatch_on_hand_routed_tokens() -> None:
    """2 nodes of 1 GPU, 3 slots each: node 0 holds experts [0, 1, 3], node 1 holds [0, 2, 3] (0 and 3 twice).
    Each token reaches the fewest nodes holding its 3 experts; an expert with a replica on several chosen
    nodes is split evenly between them."""
    pl = from_phy2log(np.array([[0, 1, 3, 0, 2, 3]]), 4)
    cl = Cluster(num_gpus=2, num_nodes=2, num_slots=6, num_groups=1, node_limit=2)
    tokens = np.array([[0, 1, 3],  # node 0 alone: slots 0, 1, 2 +1
                       [0, 2, 3],  # node 1 alone: slots 3, 4, 5 +1
                       [0, 1, 2],  # both (1 only on 0, 2 only on 1): slot 1 +1, slot 4 +1, expert 0 +0.5 on 0 and 3
                       [1, 2, 3],  # both: slot 1 +1, slot 4 +1, expert 3 +0.5 on 2 and 5
                       [3, 1, 0]])[:, None, :]  # node 0 alone again
    token_node = np.array([1, 1, 0, 1, 0])
    d = node_limited(pl, tokens, cl, token_node)
    # slot 0: t0 + t2/2 + t4; 1: t0, t2, t3, t4; 2: t0 + t3/2 + t4; 3: t1 + t2/2; 4: t1, t2, t3; 5: t1 + t3/2
    np.testing.assert_allclose(d.slot_load, [[2.5, 4.0, 2.5, 1.5, 3.0, 1.5]])
    np.testing.assert_allclose(d.gpu_load, [[9.0, 6.0]])  # 15 = 5 tokens x 3 units
    np.testing.assert_array_equal(d.nodes[:, 0], [1, 1, 2, 2, 1])
    np.testing.assert_array_equal(d.remote[:, 0], [1, 0, 1, 1, 0])  # chosen nodes other than the token's own
    assert balancedness(d.gpu_load) == pytest.approx(7.5 / 9.0, abs=1e-12)
    # the even split of the same heat [4, 4, 3, 4] (0 and 3 halved over their replicas) is another load:
    # slots [2, 4, 2, 2, 3, 2] -> GPUs [8, 7]
    heat = np.bincount(tokens.ravel(), minlength=4)[None].astype(float)
    np.testing.assert_allclose(even_gpu_load(pl, heat, cl), [[8.0, 7.0]])


def test_churn_counts_slots_whose_expert_changed() -> None:
    """Layer 0 swaps the experts of slots 2 and 3 (the replica counts stay [2, 1, 1]), layer 1 is unchanged:
    2 of 8 slots need a weight transfer. A count of replicas gained or lost would say 0."""
    prev = from_phy2log(np.array([[0, 1, 0, 2], [2, 1, 0, 0]]), 3)
    new = from_phy2log(np.array([[0, 1, 2, 0], [2, 1, 0, 0]]), 3)
    np.testing.assert_array_equal(prev.logcnt, new.logcnt)
    assert churn(prev, new) == 0.25
    assert churn(new, prev) == 0.25 and churn(prev, prev) == 0.0


def test_phy2log_gpu_load_equals_even_gpu_load_of_the_placement() -> None:
    rng = np.random.default_rng(31)
    cl = Cluster(8, 2, 24)
    ph = np.stack([rng.permutation(np.r_[np.arange(16), rng.integers(0, 16, 8)]) for _ in range(4)])  # [L, P]
    heat = rng.random((4, 16)) * 100
    np.testing.assert_array_equal(phy2log_gpu_load(ph, heat, cl), even_gpu_load(from_phy2log(ph, 16), heat, cl))
