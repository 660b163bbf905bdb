"""Aligning a re-placed layer to the previous one, so that only replicas that really move are transferred.

Inside each node, new GPUs are matched to previous GPUs greedily by the distinct experts they share (largest
overlap first, ties to the lowest (new, previous) index pair), and within a matched GPU every replica that the
previous GPU held keeps its slot (the j-th copy of an expert takes the previous GPU's j-th copy's slot); the others
fill the free slots in their order. Every layer and node at once: a Python loop over layers, nodes and slots took
~1 ms a layer, 58 ms of a drifting re-plan at [58, 256] on 8 nodes (tests/analysis/test_eplb_alignment.py checks this
against that loop).

Shape legend: R layers aligned, P slots, N nodes, G GPUs (g GPUs a node, s slots a GPU).
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster


def align(new: np.ndarray, prev: np.ndarray, cluster: Cluster) -> np.ndarray:
    """new [R, P], prev [R, P] phy2log rows -> new's rows [R, P] with GPUs relabelled inside each node and slots
    ordered so that as many as possible match prev (module doc)."""
    r = new.shape[0]
    n, g, s = cluster.num_nodes, cluster.gpus_per_node, cluster.slots_per_gpu
    a = np.asarray(new, dtype=np.int64).reshape(r * n, g, s)  # [B, g, s], B = R x N (layer, node) blocks
    b = np.asarray(prev, dtype=np.int64).reshape(r * n, g, s)
    blocks = np.arange(r * n)
    # [B, g, s, g]: new GPU i's slot u holds an expert prev GPU j holds; ORed and summed one slot at a time (numpy's
    # reductions over a short trailing axis were 4 of a 6 ms alignment at [58, 256] on 8 nodes)
    held = a[:, :, :, None] == b[:, None, None, :, 0]
    for v in range(1, s):
        held |= a[:, :, :, None] == b[:, None, None, :, v]
    rank_a = _copy_rank(a)
    held &= (rank_a == 0)[:, :, :, None]  # the first copy of each expert on its GPU (experts counted once)
    overlap = held[:, :, 0].astype(np.int64)  # [B, g, g] distinct experts new i shares with prev j
    for u in range(1, s):
        overlap += held[:, :, u]
    target = np.empty((r * n, g), dtype=np.int64)  # [B, g] prev GPU each new GPU takes
    flat = overlap.reshape(r * n, g * g)
    for _ in range(g):  # greedy: the largest overlap first; np.argmax's first maximum breaks ties
        k = np.argmax(flat, axis=1)
        i, j = k // g, k % g
        target[blocks, i] = j
        ov = flat.reshape(r * n, g, g)
        ov[blocks, i, :] = -1
        ov[blocks, :, j] = -1
    # per new GPU, the matched prev GPU's slots: a copy keeps the slot of the prev GPU's copy of the same rank
    pb = np.take_along_axis(b, target[:, :, None], 1)  # [B, g, s]
    key_a = a * s + rank_a
    key_b = pb * s + _copy_rank(pb)
    hit = key_a[:, :, :, None] == key_b[:, :, None, :]  # [B, g, s, s] at most one per row and per column
    matched = hit.any(3)
    # [B, g, s] unused slots first, in order (a stable argsort of `used`, by placing each slot: np.argsort over
    # [464, 8] rows of 5 slots was 0.6 of a 3.6 ms alignment at [58, 320] on 8 nodes)
    used = hit.any(2)
    n_free = (~used).sum(2, keepdims=True)
    place = np.where(used, n_free + np.cumsum(used, axis=2) - 1, np.cumsum(~used, axis=2) - 1)
    free = np.empty_like(place)
    np.put_along_axis(free, place, np.broadcast_to(np.arange(s), place.shape), 2)
    rest = np.cumsum(~matched, axis=2) - 1  # the k-th unmatched replica takes the k-th free slot
    slot = np.where(matched, hit.argmax(3), np.take_along_axis(free, np.maximum(rest, 0), 2))
    out = np.empty_like(a)
    rows = blocks[:, None, None]
    out[rows, target[:, :, None], slot] = a
    return out.reshape(r, cluster.num_slots)


def _copy_rank(x: np.ndarray) -> np.ndarray:
    """x [B, g, s] -> [B, g, s]: how many earlier slots of the same GPU hold the same expert."""
    if x.shape[2] > SORTED_RANK_SLOTS:
        return _copy_rank_sorted(x)
    out = np.zeros(x.shape, dtype=np.int64)
    for u in range(1, x.shape[2]):  # slot pairs v < u over [B, g] (an [B, g, s, s] compare summed over its short
        # trailing axis took 0.5 ms at [58, 320] on 8 nodes, these s (s - 1) / 2 small ones ~0.1)
        for v in range(u):
            out[:, :, u] += x[:, :, u] == x[:, :, v]
    return out


# above this many slots a GPU the pairs' loop (s (s - 1) / 2 steps) gives way to a stable sort of each GPU's slots:
# at 18 slots (two nodes, 288 slots) 0.63 -> 0.07 ms for 10 GPU blocks of 8 and level (0.91 / 0.85 ms) at 116; at 5
# slots the loop 0.11 ms against 1.1 over 464 blocks
SORTED_RANK_SLOTS = 8


def _copy_rank_sorted(x: np.ndarray) -> np.ndarray:
    """_copy_rank by a stable sort of each GPU's slots: a slot's rank is its place in its run of equal experts."""
    s = x.shape[2]
    order = np.argsort(x, axis=2, kind="stable")  # [B, g, s] slots by expert, equal ones in slot order
    runs = np.take_along_axis(x, order, 2)
    at = np.broadcast_to(np.arange(s), x.shape)
    start = np.ones(x.shape, dtype=bool)
    start[:, :, 1:] = runs[:, :, 1:] != runs[:, :, :-1]
    first = np.maximum.accumulate(np.where(start, at, 0), axis=2)  # [B, g, s] where each one's run starts
    out = np.empty(x.shape, dtype=np.int64)
    np.put_along_axis(out, order, at - first, 2)
    return out
