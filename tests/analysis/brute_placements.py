"""Every placement of a tiny cluster, by brute force: the ground truth the MILP and corner tests check against."""

from __future__ import annotations

import itertools

import numpy as np


def placement_points(load: np.ndarray, tok: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """[X, 2] (max GPU load, nodes per token) of every placement on 4 GPUs of 2 slots, GPUs 0-1 on node 0 and 2-3 on
    node 1 (slots 0-3, 4-7): each GPU a multiset of 2 experts, every expert at least once. Even split: a replica
    carries load / count; a token (a pair of experts) covers 1 node where one node holds both, else 2. counts [E]:
    only the placements with these replica counts."""
    e = len(load)
    pairs = list(itertools.combinations_with_replacement(range(e), 2))
    pts = []
    for gpus in itertools.product(pairs, repeat=4):
        slots = np.array(gpus).ravel()  # [8]
        cnt = np.bincount(slots, minlength=e)
        if (cnt == 0).any() or (counts is not None and (cnt != counts).any()):
            continue
        mx = max(load[a] / cnt[a] + load[b] / cnt[b] for a, b in gpus)
        on = [set(slots[:4].tolist()), set(slots[4:].tolist())]
        pts.append((mx, np.mean([1 if any({a, b} <= s for s in on) else 2 for a, b in tok])))
    return np.array(pts)
