"""r3trace/eplb/affinity.py's two greedy layouts against plain loops written from their docstrings.

home_primaries: per layer, experts heaviest first (equal loads by expert id), each onto the lightest home node of its
group (group_home_mask) with a free primary slot, else the lightest node with one (equal loads: the lowest node id);
node k has room for slots_per_node - (P - E) // N primaries, one fewer on the first (P - E) % N nodes. Equal nodes,
expert for expert, on shapes where each group has one home node (the planner's shortcut) and where groups span
several nodes.
affinity_replicas: extras highest load per replica first (equal: by expert id), each onto a node with a free slot
and no replica of the expert, the one with most co-choices with the experts homed there (CoChoices.node_affinity),
then the least load per replica placed so far, then the lowest node id; onto the lowest free node id when every
free node holds the expert."""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster
from r3trace.eplb.affinity import CoChoices, affinity_replicas, group_home_mask, home_primaries
from r3trace.eplb.homing import capped_counts


def reference(w: np.ndarray, cl: Cluster) -> np.ndarray:
    n_layers, e = w.shape
    n, gsize = cl.num_nodes, e // cl.num_groups
    homes = group_home_mask(w, cl)
    extra = cl.num_slots - e
    out = np.full((n_layers, e), -1)
    for li in range(n_layers):
        room = [cl.slots_per_node - extra // n - (k < extra % n) for k in range(n)]
        load = [0.0] * n
        for x in sorted(range(e), key=lambda i: (-w[li, i], i)):
            home = [k for k in range(n) if homes[li, x // gsize, k] and room[k] > 0]
            pick = home or [k for k in range(n) if room[k] > 0]
            k = min(pick, key=lambda j: (load[j], j))
            out[li, x] = k
            load[k] += w[li, x]
            room[k] -= 1
    return out


CLUSTERS = [Cluster(8, 2, 24, num_groups=4),  # groups on nodes, one home node each
            Cluster(4, 4, 16, num_groups=4),  # one group per node, no extra slots
            Cluster(12, 6, 24, num_groups=2),  # each group on a run of 3 nodes
            Cluster(9, 3, 18, num_groups=2)]  # runs of nodes, nodes with unequal room


@pytest.mark.parametrize("case", range(8))
def test_home_primaries_equals_the_reference_loop(case: int) -> None:
    rng = np.random.default_rng(300 + case)
    cl, e = CLUSTERS[case % 4], 16
    w = rng.pareto(0.8, (4, e)) + 0.05
    if case >= 4:
        w = np.round(w * 2)  # equal loads: ties by expert id, then node id
    got = home_primaries(w, cl)
    np.testing.assert_array_equal(got, reference(w, cl))
    assert (np.stack([np.bincount(row, minlength=cl.num_nodes) for row in got]) > 0).all()  # every node used


def extras_reference(w: np.ndarray, logcnt: np.ndarray, node: np.ndarray, co: CoChoices, cl: Cluster) -> np.ndarray:
    n_layers, e = w.shape
    n = cl.num_nodes
    aff = co.node_affinity(node, n)  # every row: the planner reads only those of experts with extras
    out = np.zeros((n_layers, e, n), dtype=np.int64)
    for li in range(n_layers):
        per = w[li] / logcnt[li]
        room = [cl.slots_per_node - int((node[li] == k).sum()) for k in range(n)]
        load = [float(per[node[li] == k].sum()) for k in range(n)]
        for x in range(e):
            out[li, x, node[li, x]] = 1
        extras = sorted((x for x in range(e) for _ in range(logcnt[li, x] - 1)), key=lambda i: (-per[i], i))
        for x in extras:
            free = [k for k in range(n) if room[k] > 0]
            new = [k for k in free if out[li, x, k] == 0]
            k = min(new, key=lambda j: (-aff[li, x, j], load[j], j)) if new else free[0]
            out[li, x, k] += 1
            load[k] += per[x]
            room[k] -= 1
    return out


@pytest.mark.parametrize("case", range(6))
def test_affinity_replicas_equals_the_reference_loop(case: int) -> None:
    rng = np.random.default_rng(400 + case)
    cl, e = [Cluster(8, 2, 24, num_groups=4), Cluster(12, 6, 24, num_groups=2), Cluster(8, 4, 32, num_groups=4)][
        case % 3], 16
    w = rng.pareto(0.8, (3, e)) + 0.05
    logcnt = capped_counts(w, cl.num_slots, max(cl.num_nodes, cl.gpus_per_node))
    node = home_primaries(w, cl)
    tokens = None if case >= 3 else np.stack([[rng.choice(e, 4, replace=False) for _ in range(3)] for _ in range(64)])
    co = CoChoices(tokens, e)  # without tokens every co-choice is 0 and the loads decide
    got = affinity_replicas(w, logcnt, node, co, cl)
    np.testing.assert_array_equal(got, extras_reference(w, logcnt, node, co, cl))
    assert (got.sum(2) == logcnt).all() and (got.sum(1) == cl.slots_per_node).all()
