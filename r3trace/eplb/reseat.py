"""Reseating: give a previous placement new replica counts by moving only the replicas whose count changed.

Why: re-placing an 18-node layer from scratch moves 154-247 of its 288 slots, even aligned to the previous
layer, so a 10% churn budget could re-place only 4-8 of 58 layers and the rest kept counts planned on an
older window (held out 0.814 / 0.730 / 0.527 at s = 0.3 / 0.6 / 1.0 vs fresh plans' 0.835 / 0.744 / 0.535).
Between consecutive windows a layer's counts differ by a few replicas, so reseating moves only those:
an expert that loses replicas frees the slots on the nodes where it is chosen with the fewest of the
node's experts (co-activation, as affinity.py places extras), and each expert that gains one takes the
freed slot on the node, without a replica of it yet, whose experts it is chosen with most. Every other
slot keeps its expert; leveling swaps (leveling.py) then re-pair GPUs within the rest of the budget.

Co-choices with a node's experts are summed for the one expert being seated, elementwise, not as a
[E, E] @ [E, N] product per layer: OpenBLAS ran that product on 2 threads, and with one core taken by
another job the re-plan took 0.26-0.56 s instead of 0.15 s (144 GPUs, s = 0.3 / 1.0; with
OPENBLAS_NUM_THREADS=1 0.15-0.16 s under the same load).

Shape legend: L layers, E experts, P slots, N nodes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from r3trace.eplb.placement import Cluster, PlacementError


def reseat(phy2log: np.ndarray, logcnt: np.ndarray, weight: np.ndarray, co_row: Callable[[int, int], np.ndarray],
           cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] (previous) -> phy2log [L, P] holding logcnt [L, E] replicas of each expert.

    weight [L, E] forecast loads order the gaining replicas (highest load per replica first) and break
    ties (lighter GPU partner first); co_row(layer, x) -> [E] expert x's co-choices in the newest tokens
    (affinity.CoChoices.row; zeros: ties only), read only for the experts whose count changes.
    Exactly sum(|logcnt - previous counts|) / 2 slots change; none when the counts are unchanged.
    """
    prev = np.asarray(phy2log, dtype=np.int64)
    n_layers, p = prev.shape
    e = weight.shape[1]
    if logcnt.shape != (n_layers, e) or (logcnt < 1).any() or (logcnt.sum(1) != p).any():
        raise PlacementError(f"logcnt must be [{n_layers}, {e}] with >= 1 replica each, summing to P={p}")
    out = prev.copy()
    slot_node, slot_gpu = cluster.slot_node(), cluster.slot_gpu()
    per_rep = weight / logcnt
    for layer in range(n_layers):
        have = np.bincount(prev[layer], minlength=e)
        if np.array_equal(have, logcnt[layer]):
            continue
        row = out[layer]
        on = np.zeros((e, cluster.num_nodes))  # replicas of each expert per node
        np.add.at(on, (row, slot_node), 1)
        slot_load = per_rep[layer, row]
        free: list[int] = []
        for x in np.flatnonzero(have > logcnt[layer]):
            slots = np.flatnonzero(row == x)
            aff = _node_affinity(co_row(layer, int(x)), on)
            drop = slots[np.lexsort((-slot_load[slots], aff[slot_node[slots]]))][: have[x] - logcnt[layer, x]]
            for s in drop:
                free.append(int(s))
                on[x, slot_node[s]] -= 1
        row[free] = -1
        gpu_load = np.bincount(slot_gpu, weights=np.where(row >= 0, per_rep[layer, np.maximum(row, 0)], 0.0),
                               minlength=cluster.num_gpus)
        gains = np.repeat(np.arange(e), np.maximum(logcnt[layer] - have, 0))
        tie = 1e-6 / max(float(weight[layer].sum()), 1e-12)  # below one co-choice
        for x in gains[np.argsort(-per_rep[layer, gains], kind="stable")]:
            cand = np.asarray(free)
            k = slot_node[cand]
            aff = _node_affinity(co_row(layer, int(x)), on)
            score = aff[k] - tie * gpu_load[slot_gpu[cand]] - np.where(on[x, k] > 0, 1e18, 0.0)
            s = int(cand[np.argmax(score)])
            free.remove(s)
            row[s] = x
            gpu_load[slot_gpu[s]] += per_rep[layer, x]
            on[x, slot_node[s]] += 1
    return out


def _node_affinity(coact_row: np.ndarray, on: np.ndarray) -> np.ndarray:
    """coact_row [E] co-choices of one expert, on [E, N] replicas per node -> [N] its co-choices with the
    experts each node holds (elementwise: see the module doc for why not a BLAS product)."""
    return (coact_row[:, None] * (on > 0)).sum(0)
