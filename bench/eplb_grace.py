"""A GRACE-MoE-style baseline (arXiv 2509.25041: affinity grouping + replication + locality-aware routing),
written from the paper's description for the EPLB matrix; not the authors' code (none is published).

1. Grouping by affinity: experts, heaviest first, join the node whose experts they are co-chosen with most in
   the window's tokens, among nodes with a free primary slot; ties (no tokens) go to the lightest node, so
   without tokens this is load-balanced packing. Groups of the router are ignored: GRACE groups by observed
   co-activation only. A node already 10% over the mean node load takes no more primaries while another
   node has room under that (GRACE balances load while grouping).
2. Replication: DeepSeek's rule for the counts (each extra slot to the highest load per replica); each extra
   replica goes to the lightest node with a free slot that does not hold the expert yet (GRACE replicates to
   correct load skew, not for locality).
3. Each node's replicas are packed onto its GPUs by balanced packing of their per-replica loads.
Locality-aware routing (prefer the token's own node's replica) is the scorer's node-limited dispatch here.

Shape legend: L layers, E experts, N nodes, T tokens, K top-k.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.affinity import coactivation_counts
from r3trace.eplb.deepseek import pack_nodes
from r3trace.eplb.packing import replica_counts
from r3trace.eplb.placement import Cluster, Placement, from_phy2log


def grace_policy(weight: np.ndarray, cluster: Cluster, tokens: np.ndarray | None) -> Placement:
    """weight [L, E], tokens [T, L, K] or None -> Placement (module doc)."""
    w = np.asarray(weight, dtype=np.float64)
    n_layers, e = w.shape
    n = cluster.num_nodes
    rows = np.arange(n_layers)
    logcnt = replica_counts(w, cluster.num_slots)
    coact = (coactivation_counts(tokens, e) if tokens is not None and len(tokens)
             else np.zeros((n_layers, e, e)))
    extra = cluster.num_slots - e
    cap = np.full(n, cluster.slots_per_node - extra // n)
    cap[: extra % n] -= 1
    free = np.tile(cap, (n_layers, 1))
    aff = np.zeros((n_layers, e, n))  # co-choices of each expert with each node's experts so far
    load = np.zeros((n_layers, n))
    cnt = np.zeros((n_layers, e, n), dtype=np.int64)
    tie = 1e-6 / np.maximum(w.sum(1, keepdims=True), 1e-12)
    cap_load = 1.1 * w.sum(1, keepdims=True) / n  # [L, 1]
    for ex in np.argsort(-w, axis=1, kind="stable").T:  # [L] per step, heaviest first
        room = free > 0
        under = room & (load + (w[rows, ex] / logcnt[rows, ex])[:, None] <= cap_load)
        ok = np.where(under.any(1, keepdims=True), under, room)
        score = aff[rows, ex] - tie * load + np.where(ok, 0.0, -np.inf)
        k = np.argmax(score, 1)
        cnt[rows, ex, k] = 1
        free[rows, k] -= 1
        load[rows, k] += w[rows, ex] / logcnt[rows, ex]
        aff[rows, :, k] += coact[rows, :, ex]
    free = cluster.slots_per_node - cnt.sum(1)
    per_rep = w / logcnt
    ids = np.stack([np.repeat(np.arange(e), logcnt[i] - 1) for i in range(n_layers)])  # [L, P - E]
    ids = np.take_along_axis(ids, np.argsort(-np.take_along_axis(per_rep, ids, 1), 1, kind="stable"), 1)
    for ex in ids.T:
        held = cnt[rows, ex] > 0
        k = np.argmin(load + np.where(held, 1e18, 0.0) + np.where(free > 0, 0.0, np.inf), 1)
        cnt[rows, ex, k] += 1
        free[rows, k] -= 1
        load[rows, k] += per_rep[rows, ex]
    return from_phy2log(pack_nodes(w, logcnt, cnt, cluster), e)
