"""Seeded re-plans of the spread layout (groups wider than a node): reseat, leveling swaps, plan contract."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from r3trace.eplb import Cluster, PlannerConfig, churn, plan
from r3trace.eplb.homing import capped_counts
from r3trace.eplb.leveling import level_refine
from r3trace.eplb.placement import PlacementError, check_placement, from_phy2log
from r3trace.eplb.reseat import node_affinity, reseat

CL = Cluster(72, 18, 144, num_groups=8)  # 144/18/288 scaled down: 128 experts, 2 slots per GPU
L, E = 5, 128


def _random_layout(rng: np.random.Generator, cl: Cluster = CL) -> np.ndarray:
    """[L, P]: every expert once, the extra slots random, shuffled over slots."""
    rows = [rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, cl.num_slots - E)])) for _ in range(L)]
    return np.stack(rows)


def _coact(rng: np.random.Generator) -> np.ndarray:
    c = rng.integers(0, 20, (L, E, E)).astype(float)
    c = c + c.transpose(0, 2, 1)
    c[:, np.arange(E), np.arange(E)] = 0
    return c


def _rows(coact: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """reseat's co_rows from a dense [L, E, E] matrix."""
    return lambda changes: coact[changes]


def test_reseat_moves_exactly_the_changed_counts() -> None:
    rng = np.random.default_rng(9)
    prev = _random_layout(rng)
    w = rng.pareto(1.0, (L, E)) + 0.1
    new = capped_counts(w, CL.num_slots, CL.num_nodes)
    out = reseat(prev, new, w, _rows(_coact(rng)), CL)
    pl = from_phy2log(out, E)
    np.testing.assert_array_equal(pl.logcnt, new)
    old = from_phy2log(prev, E).logcnt
    np.testing.assert_array_equal((out != prev).sum(1), np.abs(new - old).sum(1) // 2)
    kept = out == prev  # an unchanged slot keeps its expert; a changed one held a loser, now a gainer
    assert ((old - new)[np.arange(L)[:, None], prev][~kept] > 0).all()
    assert ((new - old)[np.arange(L)[:, None], out][~kept] > 0).all()


def test_reseat_unchanged_counts_is_identity_and_bad_counts_raise() -> None:
    rng = np.random.default_rng(10)
    prev = _random_layout(rng)
    w = rng.random((L, E)) + 0.1
    same = from_phy2log(prev, E).logcnt
    np.testing.assert_array_equal(reseat(prev, same, w, _rows(_coact(rng)), CL), prev)
    bad = same.copy()
    bad[0, 0] += 1  # sums to P + 1
    with pytest.raises(PlacementError):
        reseat(prev, bad, w, _rows(_coact(rng)), CL)


def test_reseat_drops_and_adds_replicas_by_co_activation() -> None:
    # one layer: experts 0..127 on slots 0..127 (nodes 0-15), extras on nodes 16 and 17; expert 0 has copies
    # on nodes 0, 16, 17 and drops two, experts 1 and 50 gain one each
    extras = [0, 2, 3, 4, 5, 6, 7, 8, 0, 9, 10, 11, 12, 13, 14, 15]
    prev = np.array([list(range(E)) + extras])
    have = np.bincount(prev[0], minlength=E)
    new = have.copy()
    new[0], new[1], new[50] = 1, 2, 2
    coact = np.zeros((1, E, E))
    coact[0, 0, 1] = coact[0, 1, 0] = 10.0  # expert 0 keeps its copy on node 0 (with expert 1)
    coact[0, 1, 9] = coact[0, 9, 1] = 10.0  # expert 1 goes to node 17, where expert 9 has a copy
    rng = np.random.default_rng(11)
    w = np.ones((1, E)) + rng.random((1, E)) * 1e-3
    w[0, 1] = w[0, 50] = 2.0  # both gain before any tie-break by load
    out = reseat(prev, new[None, :], w, _rows(coact), CL)[0]
    assert out[0] == 0 and out[128] == 50 and out[136] == 1
    np.testing.assert_array_equal(np.bincount(out, minlength=E), new)


def test_level_refine_keeps_counts_lowers_squares_and_respects_swap_budget() -> None:
    rng = np.random.default_rng(12)
    prev = _random_layout(rng)
    pl = from_phy2log(prev, E)
    w = rng.pareto(1.0, (L, E)) + 0.1
    out = level_refine(prev, w, pl.logcnt, CL, 6, 0.0)
    np.testing.assert_array_equal(from_phy2log(out, E).logcnt, pl.logcnt)
    assert ((out != prev).sum(1) <= 12).all()

    def gpu(p: np.ndarray) -> np.ndarray:
        return np.take_along_axis(w / pl.logcnt, p, 1).reshape(L, CL.num_gpus, -1).sum(-1)

    assert ((gpu(out) ** 2).sum(1) <= (gpu(prev) ** 2).sum(1) + 1e-9).all()
    assert ((gpu(out) ** 2).sum(1) < (gpu(prev) ** 2).sum(1)).any()
    # a hot expert's only replica stays on a node that held its group before (nodes per token)
    per_slot = np.take_along_axis(w / pl.logcnt, out, 1)
    mean_slot = w.sum(1, keepdims=True) / CL.num_slots
    gsize = E // CL.num_groups
    node = CL.slot_node()
    for li in range(L):
        groups_on = {(int(node[s]), int(prev[li, s]) // gsize) for s in range(CL.num_slots)}
        for s in np.flatnonzero((pl.logcnt[li, out[li]] == 1) & (per_slot[li] >= 0.5 * mean_slot[li])):
            assert (int(node[s]), int(out[li, s]) // gsize) in groups_on


def test_seeded_plan_contract_zero_move_on_same_loads_and_churn_budget() -> None:
    rng = np.random.default_rng(13)
    hist = rng.pareto(1.0, (3, L, E)) + 0.1
    tok = np.stack([np.stack([rng.choice(E, 8, replace=False) for _ in range(L)]) for _ in range(256)])
    first = plan(hist, CL, tokens=tok)
    check_placement(first, CL)
    r = int(first.logcnt.max())
    assert first.phy2log.shape == (L, CL.num_slots) and first.logcnt.shape == (L, E)
    assert first.log2phy.shape == (L, E, r) and (first.logcnt >= 1).all()
    assert ((first.log2phy >= 0).sum(2) == first.logcnt).all() and (first.log2phy[first.log2phy < 0] == -1).all()
    again = plan(hist, CL, prev=first, tokens=tok)
    # same counts: nothing to reseat, only swaps above the gain floor. Measured 0.006 with leveling, pairing and hot
    # swaps; with the E[max] swaps (emax.py) 0.015: 4 of 5 layers under the floor, one 11 of 144 slots (its fresh
    # pairing met the max-load bound but not the expected max's)
    assert churn(first, again) <= 0.02
    shifted = rng.pareto(1.0, (3, L, E)) + 0.1
    # a workload with other hot experts: the default plans it fresh (no longer fits, test_eplb_stale.py); the budget
    # holds for the seeded plan, which stale_gain < 0 keeps
    cfg = PlannerConfig(stale_gain=-1.0)
    moved = plan(shifted, CL, prev=first, tokens=tok, cfg=cfg)
    check_placement(moved, CL)
    assert churn(first, moved) == pytest.approx(float((first.phy2log != moved.phy2log).mean()))
    assert 0 < churn(first, moved) <= cfg.seeded_churn_budget
    np.testing.assert_array_equal(moved.logcnt.sum(1), CL.num_slots)


def test_churn_counts_changed_slots() -> None:
    a = from_phy2log(np.array([[0, 1, 2, 3], [3, 2, 1, 0]]), 4)
    b = from_phy2log(np.array([[0, 1, 3, 2], [3, 2, 1, 0]]), 4)
    assert churn(a, b) == pytest.approx(2 / 8)
    assert churn(a, a) == 0.0


def test_node_affinity_equals_the_matrix_product() -> None:
    # reseat sums co-choices per node elementwise (no threaded BLAS); same numbers as coact @ on
    rng = np.random.default_rng(14)
    coact = _coact(rng)[0]  # [E, E]
    on = rng.integers(0, 3, (E, CL.num_nodes)) * (rng.random((E, CL.num_nodes)) < 0.2)  # [E, N] replicas
    xs = rng.choice(E, 8, replace=False)
    np.testing.assert_array_equal(node_affinity(coact[xs], on), (coact @ (on > 0))[xs])
    on[:, 3] = 0  # a node without replicas: no co-choices with it
    assert (node_affinity(coact[xs], on)[:, 3] == 0).all()


def reseat_reference(prev: np.ndarray, logcnt: np.ndarray, w: np.ndarray, coact: np.ndarray,
                     cl: Cluster) -> np.ndarray:
    """reseat written from its docstring, one expert at a time: co-choices with each node's experts recounted
    from the current layout for every expert dropped or seated."""
    out, e = prev.copy(), w.shape[1]
    node, gpu = cl.slot_node(), cl.slot_gpu()
    for li, row in enumerate(out):
        per = w[li] / logcnt[li]
        have = np.bincount(row, minlength=e)

        def aff(x: int, li: int = li, row: np.ndarray = row) -> np.ndarray:
            """[N] x's co-choices with the experts each node holds now."""
            return np.array([sum(coact[li, x, y] for y in set(row[node == k]) if y >= 0)
                             for k in range(cl.num_nodes)])

        free = []
        for x in range(e):
            if have[x] > logcnt[li, x]:
                a = aff(x)
                slots = sorted(np.flatnonzero(row == x), key=lambda s: (a[node[s]], -per[x]))
                for s in slots[:have[x] - logcnt[li, x]]:
                    free.append(int(s))
                    row[s] = -1
        load = np.zeros(cl.num_gpus)
        np.add.at(load, gpu[row >= 0], per[row[row >= 0]])
        gains = [x for x in range(e) for _ in range(max(0, logcnt[li, x] - have[x]))]
        tie = 1e-6 / w[li].sum()
        for x in sorted(gains, key=lambda x: -per[x]):
            a = aff(x)
            # a node already holding x only when every free slot's node does (a penalty that swamps the rest)
            score = [a[node[s]] - tie * load[gpu[s]] - (1e18 if (row[node == node[s]] == x).any() else 0.0)
                     for s in free]
            s = free.pop(int(np.argmax(score)))
            row[s] = x
            load[gpu[s]] += per[x]
    return out


@pytest.mark.parametrize("seed", [15, 16, 17])
def test_reseat_matches_a_recount_per_expert(seed: int) -> None:
    rng = np.random.default_rng(seed)
    prev = _random_layout(rng)
    w = rng.pareto(1.0, (L, E)) + 0.1
    new = capped_counts(w, CL.num_slots, CL.num_nodes)
    coact = _coact(rng)
    np.testing.assert_array_equal(reseat(prev, new, w, _rows(coact), CL), reseat_reference(prev, new, w, coact, CL))
