"""alignment.align against a plain loop over nodes, GPUs and slots written from its module doc
(r3trace/eplb/alignment.py): equal phy2log, slot for slot, on random layers with repeated experts.
Run: .venv/bin/pytest tests/analysis/test_eplb_alignment.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster
from r3trace.eplb.alignment import align


def reference(new: np.ndarray, prev: np.ndarray, cl: Cluster) -> np.ndarray:
    """One layer [P]: GPUs matched greedily inside each node by distinct shared experts, then slots kept."""
    spg, gpn = cl.slots_per_gpu, cl.gpus_per_node
    out = np.empty_like(new)
    for node in range(cl.num_nodes):
        new_sets = [list(new[g * spg:(g + 1) * spg]) for g in range(node * gpn, (node + 1) * gpn)]
        prev_sets = [list(prev[g * spg:(g + 1) * spg]) for g in range(node * gpn, (node + 1) * gpn)]
        overlap = [[len(set(a) & set(b)) for b in prev_sets] for a in new_sets]
        target = [-1] * gpn
        for _ in range(gpn):
            best = max(v for row in overlap for v in row)
            a, b = next((i, j) for i in range(gpn) for j in range(gpn) if overlap[i][j] == best)
            target[a] = b
            for j in range(gpn):
                overlap[a][j] = -1
            for i in range(gpn):
                overlap[i][b] = -1
        for i, tgt in enumerate(target):
            old, slots, rest = list(prev_sets[tgt]), [-1] * spg, []
            for x in new_sets[i]:
                if x in old:
                    u = old.index(x)
                    slots[u], old[u] = x, -2  # the next copy of x takes the next copy's slot
                else:
                    rest.append(x)
            for u in range(spg):
                if slots[u] == -1:
                    slots[u] = rest.pop(0)
            g = node * gpn + tgt
            out[g * spg:(g + 1) * spg] = slots
    return out


# slots a GPU 3, 3, 1, 9, 2, 18, 36 (above alignment.SORTED_RANK_SLOTS copies are ranked by a sort)
@pytest.mark.parametrize("gpus,nodes,slots,experts", [(8, 2, 24, 16), (16, 4, 48, 8), (12, 3, 12, 12),
                                                      (32, 4, 288, 256), (144, 18, 288, 256), (16, 2, 288, 256),
                                                      (8, 1, 288, 256)])
def test_align_matches_the_loop(gpus: int, nodes: int, slots: int, experts: int) -> None:
    cl = Cluster(gpus, nodes, slots)
    rng = np.random.default_rng(gpus + slots)
    rows = 12
    prev = np.stack([rng.permutation(np.r_[np.arange(experts), rng.integers(0, experts // 4 + 1, slots - experts)])
                     for _ in range(rows)])
    new = prev.copy()
    for r in range(rows):  # a few slots re-drawn (experts repeat, GPUs gain duplicates) and GPUs shuffled
        hit = rng.choice(slots, size=max(1, slots * r // rows), replace=False)
        new[r, hit] = rng.integers(0, max(2, experts // 3), len(hit))
        new[r] = new[r].reshape(-1, cl.slots_per_gpu)[rng.permutation(gpus)].ravel()
    got = align(new, prev, cl)
    for r in range(rows):
        assert np.array_equal(got[r], reference(new[r], prev[r], cl)), r
        assert np.array_equal(np.sort(got[r].reshape(nodes, -1), 1), np.sort(new[r].reshape(nodes, -1), 1))
    assert np.array_equal(align(prev, prev, cl), prev)  # an unchanged layer stays slot for slot


def test_align_of_no_layers_is_empty() -> None:
    cl = Cluster(8, 2, 24)
    assert align(np.zeros((0, 24), dtype=np.int64), np.zeros((0, 24), dtype=np.int64), cl).shape == (0, 24)
