"""level_refine against a plain loop over candidate pairs written from its module doc (r3trace/eplb/leveling.py):
each step, per layer, the swap of a slot on one of the hottest GPUs with a slot of a partner GPU (the coldest GPUs
and the hottest GPU's node) that lowers the sum of squared GPU loads most, among the allowed ones; a layer stops
when the best drop is not above min_gain x (mean GPU load)^2. Equal phy2log, slot for slot."""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster
from r3trace.eplb.homing import capped_counts
from r3trace.eplb.leveling import _one_hot_best, level_refine
from r3trace.eplb.placement import PlacementError, from_phy2log
from r3trace.eplb.score import even_gpu_load


def reference(ph: np.ndarray, w: np.ndarray, logcnt: np.ndarray, cl: Cluster, swaps: int, min_gain: float,
              cold: float, cross_nodes: bool, hot_slots: int = 16, spread: np.ndarray | None = None) -> np.ndarray:
    """spread [R, L, E]: each deviation's squared GPU sums join the forecast's (level_refine's spread)."""
    out = ph.copy()
    spg, gpn, e = cl.slots_per_gpu, cl.gpus_per_node, w.shape[1]
    gsize = e // cl.num_groups
    node_of = np.arange(cl.num_slots) // cl.slots_per_node
    hot_n, cold_n = min(cl.num_gpus, max(1, hot_slots // spg)), min(cl.num_gpus, max(1, 4 * hot_slots // spg))
    for li in range(len(out)):
        row = out[li]
        per = w[li] / logcnt[li]
        mean = w[li].sum() / cl.num_gpus
        group_home = {(int(node_of[s]), int(row[s]) // gsize) for s in range(cl.num_slots)}  # the input's
        for _ in range(swaps):
            u = per[row]
            gpu = u.reshape(cl.num_gpus, spg).sum(1)
            rank = np.argsort(-gpu, kind="stable")  # tied loads in GPU order, as leveling.py ranks them
            hot = rank[:hot_n]
            part = list(rank[-cold_n:]) + [hot[0] // gpn * gpn + i for i in range(gpn)]
            best, pick = -np.inf, None
            for a in [g * spg + i for g in hot for i in range(spg)]:
                for b in [g * spg + i for g in part for i in range(spg)]:
                    ga, gb = a // spg, b // spg
                    if ga == gb:
                        continue
                    x, y = int(row[a]), int(row[b])
                    na, nb = int(node_of[a]), int(node_of[b])
                    if na != nb:
                        if not cross_nodes:
                            continue
                        x_on = {int(node_of[s]) for s in np.flatnonzero(row == x)}
                        y_on = {int(node_of[s]) for s in np.flatnonzero(row == y)}
                        if nb in x_on or na in y_on:
                            continue  # the swap would put a second replica of an expert on one node
                        both_extra = logcnt[li, x] > 1 and logcnt[li, y] > 1
                        kin = x // gsize == y // gsize and (na, x // gsize) in group_home \
                            and (nb, x // gsize) in group_home and not (cl.num_groups == 1 and cl.num_slots == e)
                        both_cold = u[a] < cold * mean / spg and u[b] < cold * mean / spg
                        if not (both_extra or kin or both_cold):
                            continue
                    d = u[a] - u[b]
                    gain = (gpu[ga] - gpu[gb]) * (2 * d) - (2 * d) * d
                    for dev in [] if spread is None else spread[:, li]:
                        v = (dev / logcnt[li])[row]
                        dv, gv = v[a] - v[b], v.reshape(cl.num_gpus, spg).sum(1)
                        gain += (gv[ga] - gv[gb]) * (2 * dv) - (2 * dv) * dv
                    if gain > best:
                        best, pick = gain, (a, b)
            if pick is None or not best > min_gain * mean**2:
                break
            a, b = pick
            row[a], row[b] = row[b], row[a]
    return out


def _shuffled(rng: np.random.Generator, cl: Cluster, e: int,
              n_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (Pareto loads [L, E], their capped counts [L, E], a random layout of those counts [L, P])."""
    w = rng.pareto(1.0, (n_layers, e)) + 0.05
    logcnt = capped_counts(w, cl.num_slots, max(cl.num_nodes, cl.gpus_per_node))
    ph = np.stack([rng.permutation(np.repeat(np.arange(e), logcnt[i])) for i in range(n_layers)])
    return w, logcnt, ph


@pytest.mark.parametrize("case", range(6))
def test_level_refine_equals_the_reference_loop(case: int) -> None:
    rng = np.random.default_rng(100 + case)
    cl = [Cluster(8, 4, 24, num_groups=4), Cluster(8, 2, 32, num_groups=4), Cluster(12, 3, 24, num_groups=2)][case % 3]
    e, n_layers = 16, 3
    w = rng.pareto(0.8 + 0.4 * rng.random(), (n_layers, e)) + 0.05
    if case == 5:
        w = np.round(w * 3)  # equal loads: ties broken by the first pair in (a, b) order
    logcnt = capped_counts(w, cl.num_slots, max(cl.num_nodes, cl.gpus_per_node))
    ph = np.stack([rng.permutation(np.repeat(np.arange(e), logcnt[i])) for i in range(n_layers)])
    cross, min_gain, cold = case % 2 == 0, (0.0, 0.01, 0.03)[case % 3], (0.5, 0.0, 2.0)[case % 3]
    got = level_refine(ph, w, logcnt, cl, 30, min_gain, cold, hot_slots=4, cross_nodes=cross)
    want = reference(ph, w, logcnt, cl, 30, min_gain, cold, cross, hot_slots=4)
    np.testing.assert_array_equal(got, want)
    assert (got != ph).any()  # the swaps did something to compare


@pytest.mark.parametrize("case", range(3))
def test_level_refine_with_a_spread_equals_the_reference_loop(case: int) -> None:
    """The variance terms (scenarios.spread) go through one product of a's and b's factors; the loop sums them per
    deviation and pair. Random deviations of the loads' scale, so the variance moves most picks. With 2 slots a GPU,
    trading either pair of two GPUs' replicas can give both the same experts, a tie that the product's rounding may
    break the other way, and the swaps after it then differ by GPUs traded within a node: so compared by each node's
    GPUs' expert sets."""
    rng = np.random.default_rng(700 + case)
    cl = [Cluster(8, 4, 24, num_groups=4), Cluster(8, 2, 32, num_groups=4), Cluster(12, 3, 24, num_groups=2)][case]
    e, n_layers = 16, 3
    w = rng.pareto(1.0, (n_layers, e)) + 0.05
    spread = rng.normal(0, 1, (1 + case, n_layers, e)) * w
    logcnt = capped_counts(w, cl.num_slots, max(cl.num_nodes, cl.gpus_per_node))
    ph = np.stack([rng.permutation(np.repeat(np.arange(e), logcnt[i])) for i in range(n_layers)])
    got = level_refine(ph, w, logcnt, cl, 30, 1e-3, 0.5, hot_slots=4, spread=spread)
    want = reference(ph, w, logcnt, cl, 30, 1e-3, 0.5, True, 4, spread)

    def node_sets(ph: np.ndarray) -> list[list[list[tuple[int, ...]]]]:
        gpus = np.sort(ph.reshape(n_layers, cl.num_nodes, cl.gpus_per_node, -1), 3).tolist()
        return [[sorted(map(tuple, node)) for node in layer] for layer in gpus]

    assert node_sets(got) == node_sets(want)
    plain = level_refine(ph, w, logcnt, cl, 30, 1e-3, 0.5, hot_slots=4)
    assert (got != plain).any()  # the spread changed the swaps


def test_level_refine_refuses_a_negative_gain_floor() -> None:
    cl = Cluster(8, 4, 24, num_groups=4)
    w = np.ones((1, 16))
    with pytest.raises(PlacementError, match="min_gain=-0.1 must be >= 0"):
        level_refine(np.tile(np.arange(24) % 16, (1, 1)), w, np.bincount(np.arange(24) % 16)[None], cl, 4, -0.1)


@pytest.mark.parametrize("case", range(4))
def test_long_cross_node_runs_equal_the_reference_loop(case: int) -> None:
    """Many swaps across nodes, so per-slot state (home groups, cold and replica flags) is carried through long
    chains of swaps: 2 or 4 slots per GPU on 6 nodes, 3 on 4, 4 groups, cold lone replicas allowed to move."""
    rng = np.random.default_rng(500 + case)
    cl = [Cluster(12, 6, 24 + 12 * (case // 2) * 2, num_groups=4), Cluster(8, 4, 24, num_groups=4)][case % 2]
    e, n_layers = 16, 4
    w = rng.pareto(1.0, (n_layers, e)) + 0.05
    logcnt = capped_counts(w, cl.num_slots, max(cl.num_nodes, cl.gpus_per_node))
    ph = np.stack([rng.permutation(np.repeat(np.arange(e), logcnt[i])) for i in range(n_layers)])
    got = level_refine(ph, w, logcnt, cl, 60, 0.0, 1.0, hot_slots=4)
    np.testing.assert_array_equal(got, reference(ph, w, logcnt, cl, 60, 0.0, 1.0, True, hot_slots=4))
    assert ((got != ph).sum(1) >= 6).all()  # every layer swapped several times


@pytest.mark.parametrize("slots", [16, 24])
def test_one_group_keeps_lone_experts_on_their_nodes_unless_cold(slots: int) -> None:
    """With one group every node is "its group's node", so the same-group rule would let any two lone experts trade
    nodes: on bench/eplb_matrix.py's one-group 128 GPU / 16 node / 256 slot cells re-plans that did so raised
    nodes per token from global's 4.62 to 5.31 (independent router, s = 1.2) at the same balancedness. Without a
    spare slot (16 slots, 16 experts) only cold lone replicas cross nodes; with spare slots (24) the rule stays.
    Equal to the reference loop either way."""
    rng = np.random.default_rng(7)
    cl = Cluster(8, 4, slots, num_groups=1)
    e, n_layers = 16, 3
    w = rng.pareto(1.0, (n_layers, e)) + 0.05
    logcnt = capped_counts(w, cl.num_slots, max(cl.num_nodes, cl.gpus_per_node))
    ph = np.stack([rng.permutation(np.repeat(np.arange(e), logcnt[i])) for i in range(n_layers)])
    got = level_refine(ph, w, logcnt, cl, 60, 0.0, 0.5, hot_slots=4)
    np.testing.assert_array_equal(got, reference(ph, w, logcnt, cl, 60, 0.0, 0.5, True, hot_slots=4))
    node_of = np.arange(cl.num_slots) // cl.slots_per_node
    cold = 0.5 * w.sum(1) / cl.num_gpus / cl.slots_per_gpu  # [L] cold slot load
    moved_hot = [(li, x) for li in range(n_layers) for x in np.flatnonzero(logcnt[li] == 1)
                 if set(node_of[got[li] == x]) != set(node_of[ph[li] == x]) and w[li, x] >= cold[li]]
    assert (moved_hot == []) == (slots == e), moved_hot
    assert (got != ph).any()


def test_a_cluster_with_fewer_gpus_than_the_hot_slots_ask() -> None:
    """4 GPUs of 2 slots: hot_slots = 16 asks for 8 hot GPUs; level_refine takes the 4 there are (it broadcast
    [S, B] arrays of 8 GPUs' slots against 4 and raised inside plan()), equal to the reference loop, and plan()
    returns a placement of every expert."""
    from r3trace.eplb.planner import plan

    rng = np.random.default_rng(11)
    cl = Cluster(4, 2, 8, num_groups=1)
    e, n_layers = 5, 2
    w = rng.pareto(1.0, (n_layers, e)) + 0.05
    logcnt = capped_counts(w, cl.num_slots, max(cl.num_nodes, cl.gpus_per_node))
    ph = np.stack([rng.permutation(np.repeat(np.arange(e), logcnt[i])) for i in range(n_layers)])
    got = level_refine(ph, w, logcnt, cl, 20, 0.0, 0.5)
    np.testing.assert_array_equal(got, reference(ph, w, logcnt, cl, 20, 0.0, 0.5, True))
    placed = plan(rng.random((3, n_layers, e)), cl)
    assert all(set(row) == set(range(e)) for row in placed.phy2log)


@pytest.mark.parametrize("case", range(3))
def test_a_layer_stopped_out_of_reach_ends_above_the_bar_and_the_others_are_unchanged(case: int) -> None:
    """out_of_reach: a layer stops only where the full run's max GPU load ends above its bar (the floor holds),
    its own max load then above the bar too; the layers that do not stop are the full run's."""
    rng = np.random.default_rng(700 + case)
    cl = [Cluster(32, 4, 96, num_groups=4), Cluster(24, 6, 72, num_groups=4), Cluster(32, 8, 128, num_groups=4)][case]
    e, n_layers = 32, 8
    w, logcnt, ph = _shuffled(rng, cl, e, n_layers)
    full = level_refine(ph, w, logcnt, cl, 12, 0.0, 1.0)  # 12 swaps: fewer than the GPUs
    peak = even_gpu_load(from_phy2log(full, e), w, cl).max(1)
    mean = w.sum(1) / cl.num_gpus
    # bars: the mean GPU load (out of reach), just under the full run's max load, just above it (reached at the end:
    # a looser floor stops these) and far above it
    bar = np.stack([mean, peak * 0.999, peak * (1 + 1e-9), peak * 2])[np.arange(n_layers) % 4, np.arange(n_layers)]
    got = level_refine(ph, w, logcnt, cl, 12, 0.0, 1.0, out_of_reach=bar)
    stopped = (got != full).any(1)
    assert stopped[::4].all()  # the mean is out of reach early
    assert (even_gpu_load(from_phy2log(ph, e), w, cl).max(1)[2::4] > bar[2::4]).all()  # those start above the bar
    assert (peak[stopped] > bar[stopped]).all()
    assert (even_gpu_load(from_phy2log(got, e), w, cl).max(1)[stopped] > bar[stopped]).all()
    np.testing.assert_array_equal(got[~stopped], full[~stopped])
    never = np.full(n_layers, np.inf)
    np.testing.assert_array_equal(level_refine(ph, w, logcnt, cl, 12, 0.0, 1.0, out_of_reach=never), full)


@pytest.mark.parametrize("ints", [True, False])
def test_one_hot_best_equals_the_full_argmax(ints: bool) -> None:
    """leveling._one_hot_best (near GPUs scored only where (ga - gb)^2 / 4 reaches the cold GPUs' best) against every
    pair's half drop d (x - d) - ... as level_refine's full product rounds it, d x - d d, the node rule on the cold
    GPUs' columns, np.argmax's first largest. Integer loads: many equal drops, within and across GPUs."""
    rng = np.random.default_rng(8 if ints else 9)
    for _ in range(200):
        n, spg, cold, near = int(rng.integers(1, 6)), int(rng.integers(1, 6)), int(rng.integers(1, 4)), int(
            rng.integers(0, 6))
        ns, width = spg, (cold + near) * spg
        u = rng.integers(0, 5, (n, ns + width)).astype(float) if ints else rng.pareto(1.0, (n, ns + width))
        g = np.concatenate([u[:, :ns].sum(1, keepdims=True) + rng.integers(0, 8, (n, 1)),
                            rng.integers(0, 12, (n, cold + near))], 1).astype(float)
        if not ints:
            g += rng.random(g.shape)
        ok = rng.random((n, ns, cold * spg)) < 0.7
        got = _one_hot_best(u, g, ok, ns, cold, spg, np.empty((n, ns, cold * spg)), np.empty((n, ns, cold * spg)))
        x = g[:, :1, None] - np.repeat(g[:, 1:], spg, axis=1)[:, None, :]  # [n, 1, B]
        d = u[:, :ns, None] - u[:, None, ns:]
        gain = d * x - d * d
        gain[:, :, : cold * spg] *= ok
        flat = gain.reshape(n, -1)
        best = np.argmax(flat, axis=1)
        np.testing.assert_array_equal(got[0], best)
        np.testing.assert_array_equal(got[1], flat[np.arange(n), best])


@pytest.mark.parametrize("case", range(3))
def test_per_layer_swap_caps_give_each_layer_its_own_run(case: int) -> None:
    """max_swaps [L]: each layer's row is that of a call giving every layer its count, and the reference loop's;
    with out_of_reach too (the floor reads each layer's own swaps left)."""
    rng = np.random.default_rng(800 + case)
    cl = [Cluster(16, 2, 48, num_groups=4), Cluster(24, 6, 72, num_groups=4), Cluster(32, 4, 96, num_groups=4)][case]
    e, n_layers = 32, 7
    w, logcnt, ph = _shuffled(rng, cl, e, n_layers)
    caps = rng.integers(0, 9, n_layers)
    caps[0] = 0
    got = level_refine(ph, w, logcnt, cl, caps, 0.0, 0.5)
    np.testing.assert_array_equal(got[0], ph[0])
    for li in range(n_layers):
        np.testing.assert_array_equal(got[li], level_refine(ph, w, logcnt, cl, int(caps[li]), 0.0, 0.5)[li])
        np.testing.assert_array_equal(got[li], reference(ph[li:li + 1], w[li:li + 1], logcnt[li:li + 1], cl,
                                                         int(caps[li]), 0.0, 0.5, True)[0])
    bar = even_gpu_load(from_phy2log(got, e), w, cl).max(1) * rng.choice([0.999, 2.0], n_layers)
    reach = level_refine(ph, w, logcnt, cl, caps, 0.0, 0.5, out_of_reach=bar)
    for li in range(n_layers):
        np.testing.assert_array_equal(reach[li], level_refine(ph, w, logcnt, cl, int(caps[li]), 0.0, 0.5,
                                                              out_of_reach=bar)[li])
