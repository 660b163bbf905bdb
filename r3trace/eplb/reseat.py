"""Reseating: give a previous placement new replica counts by moving only the replicas whose count changed.

Why: re-placing an 18-node layer from scratch moves 154-247 of its 288 slots, even aligned to the previous
layer, so a 10% churn budget could re-place only 4-8 of 58 layers and the rest kept counts planned on an
older window (held out 0.814 / 0.730 / 0.527 at s = 0.3 / 0.6 / 1.0 vs fresh plans' 0.835 / 0.744 / 0.535).
Between consecutive windows a layer's counts differ by a few replicas, so reseating moves only those:
an expert that loses replicas frees the slots on the nodes where it is chosen with the fewest of the
node's experts (co-activation, as affinity.py places extras), and each expert that gains one takes the
freed slot on the node, without a replica of it yet, whose experts it is chosen with most. Every other
slot keeps its expert; leveling swaps (leveling.py) then re-pair GPUs within the rest of the budget.

Co-choices with each node's experts are counted once per layer for the experts whose count changes (X of them,
[X, E] x [E, N] summed elementwise, not a BLAS product: OpenBLAS ran a per-layer [E, E] @ [E, N] product on 2
threads, and with one core taken by another job the re-plan took 0.26-0.56 s instead of 0.15 s), then kept up
to date as replicas leave and join nodes: only the moving experts' node sets change. Counts are integers, so
these sums are exact in any order and equal a recount for every expert (tests/analysis/test_eplb_seeded.py).
A row and a recount per moving expert took 30 of 57 ms of reseating at [58, 256] on 8 nodes under drift.

Shape legend: L layers, E experts, P slots, N nodes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from r3trace.eplb.placement import Cluster, PlacementError, replicas_per_node


def reseat(phy2log: np.ndarray, logcnt: np.ndarray, weight: np.ndarray,
           co_rows: Callable[[np.ndarray], np.ndarray], cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] (previous) -> phy2log [L, P] holding logcnt [L, E] replicas of each expert.

    weight [L, E] forecast loads order the gaining replicas (highest load per replica first) and break
    ties (lighter GPU partner first); co_rows(changes [L, E] bool) -> [X, E] the co-choices in the newest tokens of
    the X (layer, expert) pairs whose count changes, in (layer, expert) order (affinity.CoChoices.rows; zeros: ties
    only), read once for every layer.
    Exactly sum(|logcnt - previous counts|) / 2 slots change; none when the counts are unchanged.
    """
    prev = np.asarray(phy2log, dtype=np.int64)
    n_layers, p = prev.shape
    e = weight.shape[1]
    if logcnt.shape != (n_layers, e) or (logcnt < 1).any() or (logcnt.sum(1) != p).any():
        raise PlacementError(f"logcnt must be [{n_layers}, {e}] with >= 1 replica each, summing to P={p}")
    out = prev.copy()
    slot_node, slot_gpu = cluster.slot_node(), cluster.slot_gpu()
    node_of, gpu_of = slot_node.tolist(), slot_gpu.tolist()  # the per-slot steps below on Python ints and floats
    per_rep = weight / logcnt
    on_all = replicas_per_node(prev, e, cluster)  # [L, E, N] replicas per node; a layer's rows change only in its turn
    has = on_all.sum(2)  # [L, E] the previous counts
    changes = has != logcnt  # [L, E]
    co_all = co_rows(changes)  # [X, E] every layer's changing experts' rows, layer by layer
    ends = np.cumsum(changes.sum(1)).tolist()
    for layer in range(n_layers):
        have, want = has[layer], logcnt[layer]
        xs = np.flatnonzero(changes[layer])  # [X] the experts whose count changes
        if not len(xs):
            continue
        at = {x: i for i, x in enumerate(xs.tolist())}
        row = out[layer]
        on = on_all[layer]  # [E, N]
        co = co_all[ends[layer] - len(xs):ends[layer]]  # [X, E]
        aff = node_affinity(co, on)  # [X, N] kept equal to node_affinity(co, on) as on changes below
        slot_load = per_rep[layer, row].tolist()
        free: list[int] = []
        losers = xs[have[xs] > want[xs]]
        held_at = np.nonzero(row[None, :] == losers[:, None])[1].tolist()  # each loser's slots in turn, ascending
        first = 0
        for x in losers.tolist():
            near = aff[at[x]].tolist()
            # fewest co-choices with the slot's node first, then the heavier slot (np.lexsort's order, stable)
            slots = sorted(held_at[first:first + have[x]], key=lambda q: (near[node_of[q]], -slot_load[q]))
            first += have[x]
            for q in slots[: have[x] - want[x]]:
                free.append(q)
                on[x, node_of[q]] -= 1
                if on[x, node_of[q]] == 0:  # x left the node: its co-choices no longer count there
                    aff[:, node_of[q]] -= co[:, x]
        row[free] = -1
        gpu_load = np.bincount(slot_gpu, weights=np.where(row >= 0, per_rep[layer, np.maximum(row, 0)], 0.0),
                               minlength=cluster.num_gpus).tolist()
        up = xs[want[xs] > have[xs]]
        gains = np.repeat(up, (want - have)[up])  # each gaining replica, experts ascending
        tie = 1e-6 / max(float(weight[layer].sum()), 1e-12)  # below one co-choice
        for x in gains[np.argsort(-per_rep[layer, gains], kind="stable")].tolist():
            near, held = aff[at[x]].tolist(), on[x].tolist()
            # the free slot of most co-choices on a node without x, then the lighter GPU; the first of equals
            best, score = -1, -np.inf
            for q in free:
                v = near[node_of[q]] - tie * gpu_load[gpu_of[q]] - (1e18 if held[node_of[q]] > 0 else 0.0)
                if v > score:
                    best, score = q, v
            free.remove(best)
            row[best] = x
            gpu_load[gpu_of[best]] += float(per_rep[layer, x])
            if on[x, node_of[best]] == 0:  # x joins the node
                aff[:, node_of[best]] += co[:, x]
            on[x, node_of[best]] += 1
    return out


def node_affinity(co: np.ndarray, on: np.ndarray) -> np.ndarray:
    """co [X, E] co-choices of X experts, on [E, N] replicas per node -> [X, N] each one's co-choices with the
    experts each node holds (numpy's own einsum loop, not a BLAS product: see the module doc; integer counts, so
    exact in any order)."""
    return np.einsum("xe,en->xn", co, (on > 0).astype(co.dtype))
