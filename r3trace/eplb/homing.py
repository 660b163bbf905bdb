"""One node per expert: every replica of a logical expert sits on the same node, experts of a group together.

Why one node: a node-limited dispatcher then has exactly one cover per token (the home nodes of its K
experts), so it splits every expert's work over all of that expert's replicas, and the load it produces
equals the even-split load the plan balanced. Replicas of one expert spread over several nodes make the
cover choose among them, and a node picked for other experts of the token takes the whole share: on 4
nodes at s = 1.0 that drops DeepSeek's global policy from 0.94 (even) to 0.79 (node-limited).

Shape legend: L layers, E experts, N nodes, P slots.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster, PlacementError


def expert_nodes(weight: np.ndarray, logcnt: np.ndarray, home: np.ndarray, cluster: Cluster,
                 slack: float) -> np.ndarray:
    """Node of each expert [L, E]: highest load per replica first, onto the lightest node with room for all
    its replicas, or onto its home node when that is at most slack x the mean node load heavier.

    weight [L, E] forecast loads; logcnt [L, E] replicas (sum P per layer); home [L, E] preferred node (its
    group's, or its node in the previous placement). Where no node has room for an expert's replicas (a
    bin-packing dead end) it goes to node 0 anyway and that layer's node totals overflow: callers check.
    Ordering by load per replica is balanced packing of the
    P replicas with an expert's replicas kept together: ordering by expert load instead left nodes 13% apart
    (slot-bound nodes took the cold tail), this leaves them ~1% apart at s = 1.0 on 4 nodes.
    """
    n_layers, e = weight.shape
    n, spn = cluster.num_nodes, cluster.slots_per_node
    if int(logcnt.max()) > spn:
        raise PlacementError(f"an expert has {int(logcnt.max())} replicas, a node only {spn} slots")
    rows = np.arange(n_layers)
    tol = weight.sum(1) / n * slack  # [L]
    per_rep = weight / logcnt
    load = np.zeros((n_layers, n))
    free = np.full((n_layers, n), spn, dtype=np.int64)
    node = np.empty((n_layers, e), dtype=np.int64)
    order = np.argsort(-per_rep, axis=1, kind="stable")
    for step in range(e):
        ex = order[:, step]  # [L]
        w, c, h = weight[rows, ex], logcnt[rows, ex], home[rows, ex]
        room = np.where(free >= c[:, None], load, np.inf)  # [L, N]
        best = np.argmin(room, axis=1)
        k = np.where(room[rows, h] <= room[rows, best] + tol, h, best)
        node[rows, ex] = k
        load[rows, k] += w
        free[rows, k] -= c
    return node


def capped_counts(weight: np.ndarray, num_phy: int, cap: int) -> np.ndarray:
    """logcnt [L, E]: replicate_experts' rule (each extra slot to the highest load per replica) with at most
    `cap` replicas per expert, so all of them fit on distinct GPUs of one node (cap = GPUs per node).

    weight [L, E]; needs cap * E >= num_phy.
    """
    n_layers, e = weight.shape
    if cap * e < num_phy:
        raise PlacementError(f"{num_phy} slots need more than cap={cap} replicas for some of {e} experts")
    rows = np.arange(n_layers)
    logcnt = np.ones((n_layers, e), dtype=np.int64)
    score = np.where(logcnt < cap, weight / logcnt, -np.inf)  # [L, E] load per replica while below the cap
    for _ in range(num_phy - e):  # only the chosen expert's score changes a step
        x = np.argmax(score, axis=1)
        c = logcnt[rows, x] = logcnt[rows, x] + 1
        score[rows, x] = np.where(c < cap, weight[rows, x] / c, -np.inf)
    return logcnt
