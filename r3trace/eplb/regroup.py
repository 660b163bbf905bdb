"""Regroup: which node each GPU's slot set sits on, chosen by co-activation; every GPU keeps its load.

Without a spare slot (P = E) a token's nodes are exactly the distinct nodes of its K experts, and moving a
whole GPU's slot set to another node changes no GPU's load, so nodes per token can be lowered at no cost to
balance. The GPU co-choice matrix A [G, G] counts, over the tokens, the pairs of a token's experts that sit on two
GPUs; each step swaps two GPUs of two nodes where that raises the co-choices inside nodes, Kernighan-Lin style:
for each ordered pair of nodes (n1, n2) the GPU of n1 that gains most by moving to n2, paired with the GPU of
n2 that gains most by moving to n1, the best such swap of the layer taken while its exact gain is positive.
Only the best GPU per node pair is looked at (G x N gains a step instead of G x G pairs: the exact best pair over
G x G made a fresh plan at [58, 256] on 16 nodes take 1.1 s), and all layers step together: such a plan takes
0.27 s with the regroups, 0.07 s without, DeepSeek's reference 1.14 s (bench/eplb_matrix.plan_times' protocol).
The pairwise count stands in for the distinct nodes, which do not split
over pairs, so candidates.regrouped keeps a regrouped layer only where held-out tokens say it has fewer.
On bench/eplb_matrix.py's 128 GPU / 16 node / 256 slot cells the layouts of DeepSeek's global policy (hottest
experts one per GPU on the first nodes) and of ours' group homes keep many of a token's experts apart.

Shape legend: L layers, P slots, E experts, G GPUs, N nodes, T tokens, K top-k.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster

REGROUP_STEPS = 1  # swaps per GPU at most (128 GPUs: 128 steps; a layer of the grouped router stopped after 60-100)


def gpu_coactivation(phy2log: np.ndarray, tokens: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] with every expert once, tokens [T, L, K] -> [L, G, G] symmetric count of a token's expert
    pairs on GPUs g and h, zero diagonal."""
    n_layers, g = phy2log.shape[0], cluster.num_gpus
    gpu_of = np.empty_like(phy2log)
    gpu_of[np.arange(n_layers)[:, None], phy2log] = cluster.slot_gpu()[None, :]  # [L, E]
    gt = gpu_of[np.arange(n_layers)[None, :, None], tokens]  # [T, L, K]
    i, j = np.triu_indices(tokens.shape[2], 1)
    idx = (np.arange(n_layers) * g * g)[None, :, None] + gt[:, :, i] * g + gt[:, :, j]
    a = np.bincount(idx.ravel(), minlength=n_layers * g * g).reshape(n_layers, g, g).astype(np.float32)
    a += a.transpose(0, 2, 1)
    a[:, np.arange(g), np.arange(g)] = 0.0
    return a


def regroup(phy2log: np.ndarray, tokens: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] with every expert once, tokens [T, L, K] -> [L, P]: the same GPU slot sets, GPUs placed on
    nodes by the swaps of the module doc (GPUs of one node in their old order)."""
    if cluster.num_nodes == 1 or not len(tokens) or not len(phy2log):
        return phy2log
    return reordered(phy2log, node_order(gpu_coactivation(phy2log, tokens, cluster), cluster), cluster)


def reordered(phy2log: np.ndarray, order: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P], order [L, G] (new GPU position -> old GPU) -> [L, P] with the GPUs' slot sets moved."""
    n_layers, g = order.shape
    if not n_layers:
        return phy2log
    spg = phy2log.shape[1] // g
    return np.take_along_axis(phy2log.reshape(n_layers, g, spg), order[:, :, None], 1).reshape(n_layers, -1)


def node_order(a: np.ndarray, cluster: Cluster) -> np.ndarray:
    """GPU co-choices a [L, G, G] (gpu_coactivation) -> order [L, G]: new GPU position -> old GPU after the swaps
    of the module doc; a is left as it was."""
    n_layers, g, n, gpn = a.shape[0], cluster.num_gpus, cluster.num_nodes, cluster.gpus_per_node
    if n == 1 or not n_layers:
        return np.tile(np.arange(g), (n_layers, 1))
    members = np.tile(np.arange(g), (n_layers, 1))  # [L, G]: the GPU at each position; position p is on node p // gpn
    # kept in position order (rows follow the GPUs as they swap, columns stay GPU ids), so a GPU's own node is
    # the fixed p // gpn and the gains need no gather
    rows_a = a.copy()  # [L, G positions, G]
    d = a.reshape(n_layers, g, n, gpn).sum(-1)  # [L, G positions, N] co-choices of the GPU at p with node n's GPUs
    own = np.arange(g) // gpn
    at, live = np.arange(g), np.arange(n_layers)
    for _ in range(REGROUP_STEPS * g):
        dl = d[live]
        move = (dl - dl[:, at, own][:, :, None]).reshape(len(live), n, gpn, n)  # [l, N1, G / N, N2]: p to n2
        top = move.argmax(2)  # [l, N1, N2] position on N1 of the GPU that gains most by moving to N2
        gain = np.take_along_axis(move, top[:, :, None, :], 2)[:, :, 0, :]  # [l, N1, N2]
        pos = top + (np.arange(n) * gpn)[None, :, None]  # [l, N1, N2] its position
        who = np.take_along_axis(members[live], pos.reshape(len(live), -1), 1).reshape(pos.shape)  # its GPU id
        pair = rows_a[live[:, None], pos.reshape(len(live), -1), who.transpose(0, 2, 1).reshape(len(live), -1)]
        total = gain + gain.transpose(0, 2, 1) - 2 * pair.reshape(pos.shape)  # [l, N1, N2] exact swap gain
        best = total.reshape(len(live), -1).argmax(1)
        keep = total.reshape(len(live), -1)[np.arange(len(live)), best] > 1e-9
        if not keep.any():
            break
        live, best = live[keep], best[keep]
        n1, n2 = np.divmod(best, n)
        px, py = pos[keep, n1, n2], pos[keep, n2, n1]  # [l'] the GPU at px (on n1) and at py (on n2) trade
        x, y = members[live, px], members[live, py]
        d[live, :, n1] += rows_a[live, :, y] - rows_a[live, :, x]
        d[live, :, n2] += rows_a[live, :, x] - rows_a[live, :, y]
        for arr in (d, rows_a):
            arr[live, px], arr[live, py] = arr[live, py], arr[live, px].copy()
        members[live, px], members[live, py] = y, x
    return np.sort(members.reshape(n_layers, n, gpn), axis=2).reshape(n_layers, g)  # GPUs of a node in old order
