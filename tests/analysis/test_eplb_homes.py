"""home_primaries (r3trace/eplb/affinity.py) against a plain loop written from its docstring: per layer, experts
heaviest first (equal loads by expert id), each onto the lightest home node of its group (group_home_mask) with a
free primary slot, else the lightest node with one (equal loads: the lowest node id); node k has room for
slots_per_node - (P - E) // N primaries, one fewer on the first (P - E) % N nodes. Equal nodes, expert for expert,
on shapes where each group has one home node (the planner's shortcut) and where groups span several nodes."""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster
from r3trace.eplb.affinity import group_home_mask, home_primaries


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
