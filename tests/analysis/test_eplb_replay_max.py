"""node_limited_max (each expert's units counted per cover node set) against node_limited's max GPU load (shares
summed per token), on random layouts of odd shapes with the same seeds and chunks: the same covers, so equal up to
float rounding; node_limited_replay's nodes per token and node_limited_loads' GPU loads and nodes of every token
equal to node_limited's. Run: .venv/bin/pytest
tests/analysis/test_eplb_replay_max.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster, node_cover, replay_max
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.replay_max import MAX_LOAD_NODES, node_limited_loads, node_limited_max, node_limited_replay
from r3trace.eplb.score import node_limited


def random_layout(rng: np.random.Generator, n_layers: int, e: int, p: int) -> np.ndarray:
    """[L, P]: every expert once, the spare slots to a few hot experts (several replicas, some on one node)."""
    hot = rng.integers(0, e, max(1, e // 4))
    return np.stack([rng.permutation(np.concatenate([np.arange(e), rng.choice(hot, p - e)]))
                     for _ in range(n_layers)])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("block", [None, 60])
def test_node_limited_max_equals_the_per_token_split(seed: int, block: int | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if block is not None:  # a few tokens a block (LOAD_BLOCK choices, the last block of a chunk short)
        monkeypatch.setattr(replay_max, "LOAD_BLOCK", block)
    rng = np.random.default_rng(seed)
    for _ in range(12):
        n = int(rng.integers(1, MAX_LOAD_NODES + 2))  # one above the counted path: the fallback
        gpn, spg = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        p = n * gpn * spg
        e = int(rng.integers(max(1, p // 2), p + 1))
        # K up to 8: two nodes OR a token's 8 kinds as one uint64 (node_cover.or_over_k), other K one by one
        n_layers, k, t = int(rng.integers(1, 4)), int(rng.integers(1, min(e, 8) + 1)), int(rng.integers(1, 300))
        cl = Cluster(n * gpn, n, p)
        # one to three layouts, one call (two nodes gather two layouts' kinds at once: an odd one left over)
        pls = [from_phy2log(random_layout(rng, n_layers, e, p), e) for _ in range(int(rng.integers(1, 4)))]
        tok = np.stack([np.stack([rng.choice(e, k, replace=False) for _ in range(n_layers)]) for _ in range(t)])
        chunk = int(rng.integers(1, 120))  # several chunks: each its own draw of ties
        ds = [node_limited(pl, tok, cl, seed=seed, chunk=chunk) for pl in pls]
        want = [d.gpu_load.max(1) for d in ds]
        got = node_limited_max([pl.phy2log for pl in pls], e, tok, cl, seed=seed, chunk=chunk)
        np.testing.assert_allclose(got, want, rtol=1e-12)  # the same sums in another order
        both, nodes = node_limited_replay([pl.phy2log for pl in pls], e, tok, cl, seed=seed, chunk=chunk)
        assert (both == got).all()
        np.testing.assert_allclose(nodes, [d.nodes.mean(0) for d in ds], rtol=1e-12)  # the same covers' sizes
        for pl, d in zip(pls, ds, strict=True):  # one layout's GPU loads and every token's nodes (the report's scores)
            gpu, per_token = node_limited_loads(pl.phy2log, e, tok, cl, seed=seed, chunk=chunk)
            np.testing.assert_allclose(gpu, d.gpu_load, rtol=1e-12, atol=1e-12 * max(1.0, float(d.gpu_load.max())))
            assert np.array_equal(per_token, d.nodes)


def test_node_limited_max_by_hand() -> None:
    # 2 nodes x 1 GPU x 2 slots; expert 0 on both nodes, 1 on node 0, 2 on node 1. Token (0, 1) is covered by node
    # 0 alone (its replica of 0 takes the unit), token (0, 2) by node 1, token (1, 2) by both: GPU 0 gets 0's unit
    # of the first token, 1's two units; GPU 1 the other 0 unit and 2's two
    cl = Cluster(2, 2, 4)
    pl = from_phy2log(np.array([[0, 1, 0, 2]]), 3)
    tok = np.array([[[0, 1]], [[0, 2]], [[1, 2]]])
    assert node_limited_max([pl.phy2log], 3, tok, cl).tolist() == [[3.0]]
    assert node_limited(pl, tok, cl).gpu_load.tolist() == [[3.0, 3.0]]


@pytest.mark.parametrize(("seed", "k"), [(0, 2), (1, 3), (2, 8), (3, 8)])
def test_two_node_covers_equal_the_subset_search(seed: int, k: int) -> None:
    """node_cover.cover_codes on two nodes (its _two_node_codes) against the search written from tie_scores' doc: each
    covering subset in the draws' order, the first of the lowest scores; masks 0 (an expert on no node: code 0) to 3.
    K = 8: the kinds ORed as one uint64 a token."""
    rng = np.random.default_rng(seed)
    t, n_layers = 400, 3
    bits = rng.choice(np.arange(4, dtype=np.uint8), size=(t, n_layers, k), p=[0.03, 0.2, 0.2, 0.57])
    got = node_cover.cover_codes(bits, 2, node_cover.tie_scores(np.random.default_rng(seed), 2, t, n_layers))
    ties = list(node_cover.tie_scores(np.random.default_rng(seed), 2, t, n_layers))
    want = np.zeros((t, n_layers), dtype=np.int64)
    for i, j in np.ndindex(t, n_layers):
        low = np.inf
        for s, tie in ties:
            if all(int(b) & (s + 1) for b in bits[i, j]) and tie[i, j] < low:
                want[i, j], low = s + 1, tie[i, j]
    np.testing.assert_array_equal(got, want)
    both = (bits == 3).all(2)  # either node alone covers: the draws pick, both picks seen
    assert set(got[both].tolist()) == {1, 2} and set(got[~both].tolist()) == {0, 1, 2, 3}
