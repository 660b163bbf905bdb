"""regroup.py and candidates.regrouped: GPUs' slot sets moved between nodes by co-activation, loads kept.
Run: .venv/bin/pytest tests/analysis/test_eplb_regroup.py -q"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from r3trace.eplb import Cluster
from r3trace.eplb import regroup as regroup_mod
from r3trace.eplb.candidates import nodes_per_token, regrouped
from r3trace.eplb.regroup import gpu_coactivation, node_order, regroup


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
    out, per_token = regrouped(ph, tok, cl)
    cost = per_token.mean(0)
    np.testing.assert_array_equal(out[0], ph[0])
    assert _gpu_sets(out[1], cl) == _gpu_sets(ph[1], cl) and (out[1] != ph[1]).any()
    plain = nodes_per_token(ph, tok[t // 2:], cl)
    assert cost[0] == pytest.approx(plain[0]) and cost[1] < plain[1] - 1.0
    assert nodes_per_token(out, tok, cl)[1] == pytest.approx(1.0)


def _coactivation_loop(ph: np.ndarray, tok: np.ndarray, cl: Cluster) -> np.ndarray:
    """gpu_coactivation by a plain loop over layers, tokens and pairs of a token's positions."""
    want = np.zeros((ph.shape[0], cl.num_gpus, cl.num_gpus))
    for t, layer in itertools.product(range(tok.shape[0]), range(ph.shape[0])):
        gpus = [int(np.flatnonzero(ph[layer] == x)[0]) // cl.slots_per_gpu for x in tok[t, layer]]
        for i, j in itertools.combinations(range(tok.shape[2]), 2):
            if gpus[i] != gpus[j]:
                want[layer, gpus[i], gpus[j]] += 1
                want[layer, gpus[j], gpus[i]] += 1
    return want


@pytest.mark.parametrize("chunk", [1, 37, 1 << 18])
@pytest.mark.parametrize("gpus,nodes,slots,layers,k,t",
                         [(6, 3, 18, 5, 3, 11), (10, 2, 10, 3, 5, 7), (9, 3, 27, 4, 1, 5)])
def test_coactivation_in_chunks_equals_the_loop(monkeypatch: pytest.MonkeyPatch, chunk: int, gpus: int, nodes: int,
                                                 slots: int, layers: int, k: int, t: int) -> None:
    """Odd sizes, top-1 (no pairs) included; PAIR_CHUNK 1 and 37 make one layer a chunk and a short last chunk."""
    monkeypatch.setattr(regroup_mod, "PAIR_CHUNK", chunk)
    cl = Cluster(gpus, nodes, slots)
    rng = np.random.default_rng(gpus * 100 + k)
    ph = np.stack([rng.permutation(slots) for _ in range(layers)])
    tok = np.stack([np.stack([rng.choice(slots, k, replace=False) for _ in range(layers)]) for _ in range(t)])
    np.testing.assert_array_equal(gpu_coactivation(ph, tok.astype(np.int16), cl), _coactivation_loop(ph, tok, cl))


def _node_order_loop(a: np.ndarray, cl: Cluster) -> np.ndarray:
    """node_order by plain loops, layer by layer: each step recounts every GPU's co-choices with each node, takes per
    ordered node pair (n1, n2) the first position of n1 with the largest gain by moving to n2, and swaps the first
    node pair (in (n1, n2) order) with the largest exact swap gain while it is > 0."""
    g, n, gpn = cl.num_gpus, cl.num_nodes, cl.gpus_per_node
    out = []
    for layer in a:
        m = list(range(g))  # GPU id at each position
        for _ in range(g):
            d = [[sum(layer[m[p], m[q]] for q in range(k * gpn, (k + 1) * gpn)) for k in range(n)] for p in range(g)]

            def mover(n1: int, n2: int) -> int:
                ps = range(n1 * gpn, (n1 + 1) * gpn)
                return max(ps, key=lambda p: (d[p][n2] - d[p][n1], -p))  # noqa: B023 (d is this step's)

            best, top = None, 0.0
            for n1, n2 in itertools.product(range(n), range(n)):
                p1, p2 = mover(n1, n2), mover(n2, n1)
                gain = d[p1][n2] - d[p1][n1] + d[p2][n1] - d[p2][n2] - 2 * layer[m[p1], m[p2]]
                if gain > top:
                    best, top = (p1, p2), gain
            if best is None:
                break
            m[best[0]], m[best[1]] = m[best[1]], m[best[0]]
        out.append(np.sort(np.array(m).reshape(n, gpn), axis=1).ravel())
    return np.stack(out)


@pytest.mark.parametrize("seed", range(6))
def test_node_order_equals_the_loop_on_random_counts(seed: int) -> None:
    """Random symmetric counts of odd sizes (3-5 nodes of 1-3 GPUs), small integers so gains tie often: the order
    equals the plain loop's, ties included."""
    rng = np.random.default_rng(seed)
    n, gpn, layers = int(rng.integers(3, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    g = n * gpn
    c = rng.integers(0, 3, size=(layers, g, g)).astype(np.float32)
    a = c + c.transpose(0, 2, 1)
    a[:, np.arange(g), np.arange(g)] = 0.0
    cl = Cluster(g, n, g)
    np.testing.assert_array_equal(node_order(a, cl), _node_order_loop(a, cl))


def test_regrouped_stack_of_two_layouts_equals_two_calls() -> None:
    """candidates.best_layout regroups ours' and global's layers as one stack: each layer's result and count are
    those of regrouping its layout alone."""
    cl = Cluster(16, 4, 32)
    rng = np.random.default_rng(3)
    ph = np.stack([rng.permutation(32) for _ in range(6)])
    team = [ph[0].reshape(16, 2)[g].ravel() for g in rng.permutation(16).reshape(4, 4)]
    tok = np.stack([np.stack([rng.choice(team[rng.integers(4)], 4, replace=False) for _ in range(3)])
                    for _ in range(600)])  # [T, 3, 4]
    layers = np.array([True, False, True, True, True, False])
    out, cost = regrouped(ph, np.concatenate([tok, tok], 1), cl, layers)
    for half in (0, 3):
        o, c = regrouped(ph[half:half + 3], tok, cl, layers[half:half + 3])
        np.testing.assert_array_equal(out[half:half + 3], o)
        np.testing.assert_array_equal(cost[:, half:half + 3], c)
    assert (out != ph).any()
