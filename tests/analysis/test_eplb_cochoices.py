"""CoChoices (the planner's co-choice counts, read where needed) against the dense coactivation matrix."""

from __future__ import annotations

import numpy as np

from r3trace.eplb.affinity import CoChoices, coactivation_counts


def _tokens(rng: np.random.Generator, t: int = 300, n_layers: int = 3, e: int = 24, k: int = 4) -> np.ndarray:
    """[T, L, K] distinct experts per token, Zipf-ish popularity; token 0 of layer 0 repeats an expert."""
    pop = 1 / np.arange(1, e + 1) ** 0.8
    tok = np.stack([[rng.choice(e, k, replace=False, p=pop / pop.sum()) for _ in range(n_layers)] for _ in range(t)])
    tok[0, 0, 1] = tok[0, 0, 0]  # a duplicate id: the dense matrix counts the pair on its diagonal, so must we
    return tok


def test_node_affinity_and_rows_equal_the_dense_matrix() -> None:
    rng = np.random.default_rng(21)
    tok = _tokens(rng)
    e, n = 24, 5
    dense = coactivation_counts(tok, e).astype(np.float64)  # [L, E, E]
    co = CoChoices(tok, e)
    node = rng.integers(0, n, (3, e))
    onehot = np.zeros((3, e, n))
    onehot[np.arange(3)[:, None], np.arange(e)[None, :], node] = 1
    np.testing.assert_array_equal(co.node_affinity(node, n), dense @ onehot)
    rows = rng.random((3, e)) < 0.3  # only these experts' rows counted, the others 0
    np.testing.assert_array_equal(co.node_affinity(node, n, rows), np.where(rows[:, :, None], dense @ onehot, 0))
    none = co.node_affinity(node, n, np.zeros((3, e), dtype=bool))  # P = E: no row wanted
    assert none.shape == (3, e, n) and none.dtype == np.float64 and not none.any()
    for layer in range(3):
        for x in range(e):
            np.testing.assert_array_equal(co.row(layer, x), dense[layer, x])
        xs = rng.choice(e, 7)  # repeats allowed
        np.testing.assert_array_equal(co.rows(layer, xs), dense[layer, xs])
    assert co.rows(1, np.zeros(0, dtype=np.int64)).shape == (0, e)


def test_without_tokens_everything_is_zero() -> None:
    co = CoChoices(None, 8)
    assert not co.node_affinity(np.zeros((2, 8), dtype=np.int64), 3).any()
    assert co.node_affinity(np.zeros((2, 8), dtype=np.int64), 3).shape == (2, 8, 3)
    assert not co.row(1, 5).any()
    assert co.rows(1, np.array([2, 5])).shape == (2, 8)
