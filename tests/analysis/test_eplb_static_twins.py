"""The static planner's fast paths against plain twins: static_expected_load (counts per replica) against
dispatched_load of the uniform demand (per rank and expert), cover_sizes (forced nodes, then subsets) against
enumerating every node subset, static_even_ladder's rungs against static_even at each tau alone, and the leveling's
batch against a swap-by-swap loop over one layout at a time. Random layouts of odd shapes, mixed experts included."""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster, global_policy, static
from r3trace.eplb.cover import cover_sizes
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.score import heat_of
from r3trace.eplb.static import dispatched_load, static_expected_load
from r3trace.eplb.static_spread import LEVEL_SHARE, EvenMoves, _level, mixed, static_even, static_even_ladder
from tests.analysis.test_eplb_static_spread import per_node, skewed


def random_layout(rng: np.random.Generator, n_layers: int, e: int, p: int) -> np.ndarray:
    """[L, P]: every expert once, the spare slots to random experts, slots shuffled (mixed experts likely)."""
    return np.stack([rng.permutation(np.concatenate([np.arange(e), rng.integers(0, e, p - e)]))
                     for _ in range(n_layers)])


@pytest.mark.parametrize("seed", range(6))
def test_expected_load_equals_the_uniform_demand_dispatched(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(20):
        n, gpn, spg = int(rng.choice([1, 2, 3, 4, 8])), int(rng.integers(1, 5)), int(rng.integers(1, 5))
        g = n * gpn
        p = g * spg
        e = int(rng.integers(1, p + 1))
        ph = random_layout(rng, int(rng.integers(1, 4)), e, p)
        w = rng.random((len(ph), e)) * 100
        cl = Cluster(g, n, p)
        uniform = np.broadcast_to(w[:, None, :] / g, (len(ph), g, e))  # every rank sends 1 / G of each expert
        for how in ("static", "dynamic"):
            for prefer in (True, False):
                want = dispatched_load(from_phy2log(ph, e), uniform, cl, how, prefer)
                got = static_expected_load(ph, w, cl, prefer, how)
                # the same sums in another order: float rounding only
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * w.sum())


def test_expected_load_in_blocks_equals_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows in blocks of EXPECTED_BLOCK slots (one row, then two): each row's loads are its own, bit for bit."""
    rng = np.random.default_rng(31)
    cl = Cluster(12, 3, 36)
    ph = random_layout(rng, 7, 29, 36)
    w = rng.random((7, 29)) * 100
    whole = static_expected_load(ph, w, cl)
    for block in (36, 72):
        monkeypatch.setattr(static, "EXPECTED_BLOCK", block)
        assert np.array_equal(static_expected_load(ph, w, cl), whole)
    assert static_expected_load(ph[:0], w[:0], cl).shape == (0, 12)


def test_expected_load_by_hand() -> None:
    # 2 nodes x 8 GPUs, expert 0 on GPUs 0, 1 and 8: the node rule gives 7, 1 and 8 of the 16 ranks (static.py)
    cl = Cluster(16, 2, 32)
    ph = np.array([[0, 1, 0, 2] + list(range(3, 15)) + [0, 15] + list(range(16, 30))])  # [1, 32]
    w = np.zeros((1, 30))
    w[0, 0] = 16.0
    got = static_expected_load(ph, w, cl)[0]
    assert got[[0, 1, 8]].tolist() == [7.0, 1.0, 8.0] and got.sum() == 16.0
    assert static_expected_load(ph, w, cl, prefer_same_node=False)[0][[0, 1, 8]].tolist() == [5.0 + 1, 5.0, 5.0]


def brute_cover(masks: np.ndarray, tok: np.ndarray, n: int, layer: np.ndarray) -> np.ndarray:
    """[T, M]: the fewest of every node subset holding each token's K experts."""
    out = np.full((len(tok), len(masks)), n + 1)
    for s in range(1, 1 << n):
        meets = (masks[np.arange(len(masks))[None, :, None], tok[:, layer]] & s) != 0  # [T, M, K]
        out = np.where(meets.all(2), np.minimum(out, bin(s).count("1")), out)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_cover_sizes_equal_every_subset_tried(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    for _ in range(15):
        n, e, n_layers = int(rng.integers(1, 9)), int(rng.integers(2, 40)), int(rng.integers(1, 5))
        rows, k, t = int(rng.integers(1, 9)), int(rng.integers(1, 7)), int(rng.integers(1, 200))
        multi = rng.random()  # share of experts on several nodes: 0 .. 1, the subset search's tokens included
        masks = np.where(rng.random((rows, e)) < multi, rng.integers(1, 1 << n, (rows, e)),
                         1 << rng.integers(0, n, (rows, e))).astype(np.int64)
        tok = rng.integers(0, e, (t, n_layers, k))
        layer = rng.integers(0, n_layers, rows)
        assert np.array_equal(cover_sizes(masks, tok, n, layer), brute_cover(masks, tok, n, layer).T)


def test_cover_sizes_of_experts_on_every_node() -> None:
    # no forced node and nothing missed by it: one node covers a token whose experts all sit on all 8 (0xFF)
    masks = np.array([[0xFF, 0xFF, 0b11, 0b1100, 0b110000, 0b11000000]])  # [1, 6]
    tok = np.array([[[0, 1]], [[0, 2]], [[2, 3]], [[3, 4]]])  # [4, 1, 2]
    want = brute_cover(masks, tok, 8, np.zeros(1, dtype=np.int64)).T
    assert np.array_equal(cover_sizes(masks, tok, 8), want) and want[0].tolist() == [1, 1, 2, 2]
    tok4 = np.array([[[2, 3, 4, 5]], [[0, 1, 0, 1]]])  # four pairs of nodes: 4 nodes; all-node experts: 1
    assert cover_sizes(masks, tok4, 8)[0].tolist() == [4, 1]


@pytest.mark.parametrize("g, n, p, e, s, seed", [(16, 2, 288, 256, 1.2, 0), (32, 4, 288, 256, 0.9, 1),
                                                 (24, 3, 168, 128, 1.0, 2), (16, 4, 80, 64, 0.6, 3)])
def test_ladder_rungs_are_static_even_at_each_tau(g: int, n: int, p: int, e: int, s: float, seed: int) -> None:
    taus = (4.0, 2.0, 1.0, 0.5, 0.25, 0.0)
    heat = heat_of(skewed(seed, e, 3, 1500, 8, s), e)
    cl = Cluster(g, n, p)
    ph = global_policy(heat, cl).phy2log  # DeepSeek's layout: mixed experts on several nodes
    assert any(mixed(k) for k in per_node(ph, e, cl).reshape(-1, n))
    ladder = static_even_ladder(ph, heat, cl, taus)
    distinct = 0
    for i, tau in enumerate(taus):
        assert np.array_equal(ladder[i], static_even(ph, heat, cl, tau))
        distinct += i > 0 and not np.array_equal(ladder[i], ladder[i - 1])
    assert distinct >= 1  # lower floors fix more experts


def level_one(ph: np.ndarray, share: np.ndarray, gpu_load: np.ndarray, cl: Cluster, steps: int) -> None:
    """One layout in place, a swap at a time: the swap off the hottest GPU whose two GPUs' higher load after it is
    least (the first such in slot order), over pairs on one node or whose moved experts are not mixed after it,
    counted afresh."""
    spg, node = cl.slots_per_gpu, np.arange(len(ph)) // cl.slots_per_node
    e = len(share)
    for _ in range(steps):
        h = int(np.argmax(gpu_load))
        top, best = gpu_load[h], None
        for a in range(h * spg, (h + 1) * spg):
            for b in range(len(ph)):
                x, f = ph[a], ph[b]
                if b // spg == h or x == f:
                    continue
                delta = share[f] - share[x]
                worst = max(top + delta, gpu_load[b // spg] - delta)
                moved = ph.copy()
                moved[a], moved[b] = f, x
                counts = per_node(moved[None], e, cl)[0]
                stays = node[a] == node[b] or not (mixed(counts[x]) or mixed(counts[f]))  # one node: counts kept
                if worst < top * (1 - 1e-9) and stays and (best is None or worst < best[0]):
                    best = (worst, a, b)
        if best is None:
            return
        _, a, b = best
        gpu_load[a // spg] += share[ph[b]] - share[ph[a]]
        gpu_load[b // spg] += share[ph[a]] - share[ph[b]]
        ph[a], ph[b] = ph[b], ph[a]


@pytest.mark.parametrize("g, n, p, e, seed", [(8, 2, 24, 16, 0), (12, 3, 36, 20, 1), (16, 4, 48, 40, 2)])
def test_leveling_batch_equals_one_layout_at_a_time(g: int, n: int, p: int, e: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cl = Cluster(g, n, p)
    ph = random_layout(rng, 6, e, p)  # mixed experts among them
    w = rng.random((6, e)) * 50
    cnt = np.stack([np.bincount(row, minlength=e) for row in ph])
    share = w / cnt
    load = np.stack([np.bincount(np.arange(p) // cl.slots_per_gpu, weights=s[row], minlength=g)
                     for row, s in zip(ph, share, strict=True)])  # [B, G]
    steps = max(int(LEVEL_SHARE * p / 2), 3)
    ids = ph + (np.arange(6) * e)[:, None]  # expert ids unique per layout, as static_even_ladder batches them
    ok = EvenMoves(per_node(ph, e, cl).reshape(-1, n), cnt.ravel())
    got_load = load.copy()
    _level(ids, share.ravel(), got_load, np.arange(p) // cl.slots_per_node, cl.slots_per_gpu, steps, ok)
    moved = 0
    for i in range(6):
        want, want_load = ph[i].copy(), load[i].copy()
        level_one(want, share[i], want_load, cl, steps)
        assert np.array_equal(ids[i] - i * e, want) and np.array_equal(got_load[i], want_load)
        moved += int((want != ph[i]).sum())
    assert moved > 0
