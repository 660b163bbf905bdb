"""regroup.py and candidates.regrouped: GPUs' slot sets moved between nodes by co-activation, loads kept.
Run: .venv/bin/python -m pytest tests/analysis/test_eplb_regroup.py -q"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from r3trace.eplb import Cluster
from r3trace.eplb.candidates import nodes_per_token, regrouped
from r3trace.eplb.regroup import gpu_coactivation, regroup


def _gpu_sets(ph: np.ndarray, cl: Cluster) -> list[tuple[int, ...]]:
    return sorted(tuple(sorted(x)) for x in ph.reshape(cl.num_gpus, cl.slots_per_gpu).tolist())


def test_coactivation_counts_pairs_of_a_tokens_experts_by_gpu() -> None:
    """Against a plain loop over tokens and pairs (2 layers, 8 GPUs of 2 slots, top-3)."""
    cl = Cluster(8, 4, 16)
    rng = np.random.default_rng(0)
    ph = np.stack([rng.permutation(16) for _ in range(2)])
    tok = np.stack([np.stack([rng.choice(16, 3, replace=False) for _ in range(2)]) for _ in range(50)])  # [T, L, K]
    want = np.zeros((2, 8, 8))
    for t, layer in itertools.product(range(50), range(2)):
        gpus = [int(np.flatnonzero(ph[layer] == x)[0]) // 2 for x in tok[t, layer]]
        for i, j in itertools.combinations(range(3), 2):
            if gpus[i] != gpus[j]:
                want[layer, gpus[i], gpus[j]] += 1
                want[layer, gpus[j], gpus[i]] += 1
    np.testing.assert_array_equal(gpu_coactivation(ph, tok, cl), want)


def test_regroup_finds_the_split_that_puts_every_token_on_one_node() -> None:
    """16 GPUs of 2 experts on 4 nodes; tokens pick 4 experts among the 8 of one hidden team of 4 GPUs, teams
    scattered over nodes: regrouped, every token is on one node (nothing is lower); GPU slot sets are kept."""
    cl = Cluster(16, 4, 32)
    rng = np.random.default_rng(1)
    team_gpus = rng.permutation(16).reshape(4, 4)  # hidden teams of GPUs
    ph = rng.permutation(32)
    team_experts = [ph.reshape(16, 2)[g].ravel() for g in team_gpus]
    tok = np.stack([rng.choice(team_experts[rng.integers(4)], 4, replace=False) for _ in range(400)])[:, None]
    assert nodes_per_token(ph[None], tok, cl)[0] > 2.5
    out = regroup(ph[None], tok, cl)
    assert _gpu_sets(out[0], cl) == _gpu_sets(ph, cl)
    assert nodes_per_token(out, tok, cl)[0] == pytest.approx(1.0)


def test_regrouped_keeps_a_layer_whose_tokens_carry_no_pairs_beyond_chance() -> None:
    """Layer 0: uniform random tokens (no co-activation structure): the order fitted on the older half is not
    lower by 2 standard errors on the newer half, so the layer stays as it was. Layer 1: team tokens as above:
    regrouped, fewer nodes per token on the held-out half."""
    cl = Cluster(16, 4, 32)
    rng = np.random.default_rng(2)
    ph = np.stack([rng.permutation(32) for _ in range(2)])
    team = [ph[1].reshape(16, 2)[g].ravel() for g in rng.permutation(16).reshape(4, 4)]
    t = 2000
    noise = np.stack([rng.choice(32, 4, replace=False) for _ in range(t)])
    teams = np.stack([rng.choice(team[rng.integers(4)], 4, replace=False) for _ in range(t)])
    tok = np.stack([noise, teams], 1)  # [T, 2, 4]
    out, cost = regrouped(ph, tok, cl)
    np.testing.assert_array_equal(out[0], ph[0])
    assert _gpu_sets(out[1], cl) == _gpu_sets(ph[1], cl) and (out[1] != ph[1]).any()
    plain = nodes_per_token(ph, tok[t // 2:], cl)
    assert cost[0] == pytest.approx(plain[0]) and cost[1] < plain[1] - 1.0
    assert nodes_per_token(out, tok, cl)[1] == pytest.approx(1.0)
