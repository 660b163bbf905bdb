"""CoChoices (the planner's co-choice counts, read where needed) against the dense coactivation matrix."""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import affinity
from r3trace.eplb.affinity import CoChoices, coactivation_counts


def _tokens(rng: np.random.Generator, t: int = 300, n_layers: int = 3, e: int = 24, k: int = 4) -> np.ndarray:
    """[T, L, K] distinct experts per token, Zipf-ish popularity; token 0 of layer 0 repeats an expert."""
    pop = 1 / np.arange(1, e + 1) ** 0.8
    tok = np.stack([[rng.choice(e, k, replace=False, p=pop / pop.sum()) for _ in range(n_layers)] for _ in range(t)])
    tok[0, 0, 1] = tok[0, 0, 0]  # a duplicate id: the dense matrix counts the pair on its diagonal, so must we
    return tok


@pytest.mark.parametrize("n", [2, 4, 5])
def test_node_affinity_and_rows_equal_the_dense_matrix(n: int) -> None:
    """Two and four nodes: counts per node a token (_node_sums); five: pairs (_pairs)."""
    rng = np.random.default_rng(21 + n)
    tok = _tokens(rng)
    e = 24
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
    np.testing.assert_array_equal(co.rows(np.ones((3, e), dtype=bool)), dense.reshape(-1, e))
    want = rng.random((3, e)) < 0.3
    np.testing.assert_array_equal(co.rows(want), dense[want])
    assert co.rows(np.zeros((3, e), dtype=bool)).shape == (0, e)


def test_rows_over_many_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of a few tokens (the last one short) sum to the same rows."""
    rng = np.random.default_rng(22)
    tok = _tokens(rng, t=97, n_layers=4, e=19, k=3)
    dense = coactivation_counts(tok, 19).astype(np.float64)
    want = rng.random((4, 19)) < 0.4
    monkeypatch.setattr(affinity, "ROWS_BLOCK", 4 * 3 * 5)  # 5 tokens a block: 20 blocks
    np.testing.assert_array_equal(CoChoices(tok, 19).rows(want), dense[want])
    for n in (3, 6):  # node_affinity's per-node sums and its pairs, over the same blocks
        node = rng.integers(0, n, (4, 19))
        onehot = (node[:, :, None] == np.arange(n)).astype(np.float64)
        np.testing.assert_array_equal(CoChoices(tok, 19).node_affinity(node, n, want),
                                      np.where(want[:, :, None], dense @ onehot, 0))


def test_without_tokens_everything_is_zero() -> None:
    co = CoChoices(None, 8)
    assert not co.node_affinity(np.zeros((2, 8), dtype=np.int64), 3).any()
    assert co.node_affinity(np.zeros((2, 8), dtype=np.int64), 3).shape == (2, 8, 3)
    want = np.zeros((2, 8), dtype=bool)
    want[1, [2, 5]] = True
    rows = co.rows(want)
    assert rows.shape == (2, 8) and not rows.any()
