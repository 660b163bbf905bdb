"""DeepSeek's EPLB policies and SGLang's cross-node replication idea, from their published descriptions.

hierarchical: pack expert groups onto nodes, replicate inside each node, pack replicas onto the node's GPUs.
global_policy: hierarchical with one group and one node (replicas anywhere, groups ignored).
cross_node: groups onto nodes as hierarchical, but replica counts are decided globally and extra replicas
go to the least-loaded node with room, preferring nodes without that expert (SGLang's proposal to put hot
experts on other nodes, so tokens homed there reach them over NVLink).
Input weight [L, E] (load per logical expert); output Placement (phy2log [L, P], log2phy [L, E, R], logcnt).
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.packing import balanced_packing, replica_counts, replicate_experts, torch_order
from r3trace.eplb.placement import Cluster, Placement, PlacementError, from_phy2log, slot_order


def hierarchical(weight: np.ndarray, cluster: Cluster) -> Placement:
    """weight [L, E] -> Placement with every replica of a group's experts on the group's node."""
    phy2log, rank = _hierarchical(weight, cluster)
    # log2phy by replica rank, as rebalance_experts writes it (not by ascending slot)
    return from_phy2log(phy2log, np.shape(weight)[1], rank=rank)


def _hierarchical(weight: np.ndarray, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
    """weight [L, E] -> hierarchical's (phy2log [L, P], each slot's replica rank [L, P])."""
    w = np.asarray(weight, dtype=np.float64)
    n_layers, e = w.shape
    gr, n, p = cluster.num_groups, cluster.num_nodes, cluster.num_slots
    if e % gr or gr % n:
        raise PlacementError(f"num_groups={gr} must divide E={e} and be a multiple of num_nodes={n}")
    gsize, gpn = e // gr, gr // n
    gw = w.reshape(n_layers, gr, gsize).sum(-1)  # [L, groups]
    gpack, grank = balanced_packing(gw, n, torch_order(gw))  # ties as the reference breaks them
    log2mlog = (((gpack * gpn + grank) * gsize)[:, :, None] + np.arange(gsize)).reshape(n_layers, e)
    mlog2log = slot_order(log2mlog)  # a permutation per row: any sort's order
    w_mlog = np.take_along_axis(w, mlog2log, 1).reshape(n_layers * n, e // n)
    phy2mlog, phyrank, mlogcnt = replicate_experts(w_mlog, p // n)  # [L*N, P/N]
    w_phy = np.take_along_axis(w_mlog / mlogcnt, phy2mlog, 1)
    pack, rank = balanced_packing(w_phy, cluster.gpus_per_node, torch_order(w_phy))
    pphy2phy = slot_order(pack * cluster.slots_per_gpu + rank)  # a permutation per row
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, 1).reshape(n_layers, n, -1)
    pphy2mlog = (pphy2mlog + (np.arange(n) * (e // n))[None, :, None]).reshape(n_layers, p)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, 1).reshape(n_layers, p)  # replica rank of each slot
    return np.take_along_axis(mlog2log, pphy2mlog, 1), pphyrank


def global_policy(weight: np.ndarray, cluster: Cluster) -> Placement:
    """weight [L, E] -> Placement ignoring groups and nodes (EPLB's choice when groups % nodes != 0)."""
    return hierarchical(weight, _one_node(cluster))


def global_phy2log(weight: np.ndarray, cluster: Cluster) -> np.ndarray:
    """weight [L, E] -> global_policy's phy2log [L, P] alone (its log2phy was 0.8 of a 5 ms call at [58, 320])."""
    return _hierarchical(weight, _one_node(cluster))[0]


def _one_node(cluster: Cluster) -> Cluster:
    return Cluster(cluster.num_gpus, 1, cluster.num_slots, num_groups=1, node_limit=cluster.node_limit)


def group_nodes(weight: np.ndarray, cluster: Cluster) -> np.ndarray:
    """Home node of each logical expert [L, E].

    When nodes divide the groups, groups are packed onto nodes by balanced_packing of group loads, so a
    token that picks <= 4 groups reaches <= 4 nodes. Otherwise (144 GPUs on 18 nodes, 8 groups) a node
    cannot hold whole groups; experts are homed in contiguous group order, E/N per node, so a group
    spans as few nodes as possible (32 experts over ~2.3 nodes of 14).
    """
    n_layers, e = weight.shape
    gr = cluster.num_groups
    if e % gr:
        raise PlacementError(f"num_groups={gr} must divide E={e}")
    if gr % cluster.num_nodes:
        return np.tile(np.arange(e) * cluster.num_nodes // e, (n_layers, 1))
    gpack, _ = balanced_packing(weight.reshape(n_layers, gr, e // gr).sum(-1), cluster.num_nodes)
    return np.repeat(gpack, e // gr, axis=1)


def spread_replicas(weight: np.ndarray, logcnt: np.ndarray, home: np.ndarray, cluster: Cluster) -> np.ndarray:
    """Replicas per (layer, expert, node) [L, E, N]: one on the home node, extras greedily on other nodes.

    Extras are placed heaviest per-replica load first, each on the least-loaded node with a free slot that
    does not hold the expert yet (a node that does only if none is left).
    """
    n_layers, e = weight.shape
    n = cluster.num_nodes
    rows = np.arange(n_layers)
    cnt = np.zeros((n_layers, e, n), dtype=np.int64)
    cnt[rows[:, None], np.arange(e)[None, :], home] = 1
    per_rep = weight / logcnt  # [L, E]
    node_load = np.zeros((n_layers, n))
    np.add.at(node_load, (np.repeat(rows, e), home.ravel()), per_rep.ravel())
    free = cluster.slots_per_node - np.stack([(home == k).sum(1) for k in range(n)], axis=1)  # [L, N]
    if (free < 0).any():
        raise PlacementError(f"a node holds more home experts than its {cluster.slots_per_node} slots")
    extra = logcnt - 1
    n_extra = int(extra[0].sum())
    # [L, n_extra] expert of each extra replica, heaviest per-replica load first
    ids = np.stack([np.repeat(np.arange(e), extra[i]) for i in range(n_layers)])
    order = np.argsort(-np.take_along_axis(per_rep, ids, 1), axis=1, kind="stable")
    ids = np.take_along_axis(ids, order, 1)
    for j in range(n_extra):
        ex = ids[:, j]
        held = cnt[rows, ex] > 0  # [L, N]
        score = node_load + np.where(held, 1e18, 0.0) + np.where(free > 0, 0.0, np.inf)
        k = np.argmin(score, axis=1)
        cnt[rows, ex, k] += 1
        node_load[rows, k] += per_rep[rows, ex]
        free[rows, k] -= 1
    return cnt


def pack_nodes(weight: np.ndarray, logcnt: np.ndarray, cnt: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] from replicas per node cnt [L, E, N]: balanced_packing of each node's replicas (all L x N
    (layer, node) rows in one call: a loop per node was 4-8 ms of a [58, 256] plan)."""
    n_layers, e, n = cnt.shape
    spn = cluster.slots_per_node
    per_node = cnt.transpose(0, 2, 1).reshape(n_layers * n, e)  # [L N, E]
    if (per_node.sum(1) != spn).any():
        raise PlacementError(f"replicas per node must fill its {spn} slots")
    ids = np.repeat(np.tile(np.arange(e), n_layers * n), per_node.ravel()).reshape(n_layers * n, spn)  # [L N, P/N]
    per_rep = np.repeat(weight / logcnt, n, axis=0)  # [L N, E]
    pack, rank = balanced_packing(np.take_along_axis(per_rep, ids, 1), cluster.gpus_per_node)
    slot = (pack * cluster.slots_per_gpu + rank).reshape(n_layers, n * spn) + np.repeat(np.arange(n) * spn, spn)
    phy2log = np.empty((n_layers, cluster.num_slots), dtype=np.int64)
    phy2log[np.arange(n_layers)[:, None], slot] = ids.reshape(n_layers, n * spn)
    return phy2log


def cross_node(weight: np.ndarray, cluster: Cluster) -> Placement:
    """weight [L, E] -> Placement: groups homed on nodes, hot experts also replicated on other nodes."""
    w = np.asarray(weight, dtype=np.float64)
    logcnt = replica_counts(w, cluster.num_slots)
    cnt = spread_replicas(w, logcnt, group_nodes(w, cluster), cluster)
    return from_phy2log(pack_nodes(w, logcnt, cnt, cluster), w.shape[1])
