"""Which expert groups share a node under keep_groups: of the ways to split the groups evenly over the nodes, the one
whose tokens reach the fewest nodes, among those whose heaviest node is within `slack` of balanced packing's.

Why: with whole groups on nodes (keep_groups, DeepSeek's hierarchical layout) a token reaches the nodes of the groups
its experts sit in, so which groups share a node sets its nodes per token. DeepSeek packs groups onto nodes by load
alone (balanced_packing of group loads); a router's tokens choose some groups together (V3's group-limited routing
keeps 4 of 8), and pairing those on a node saves a node for each token that picks both. The splits are few (8
groups: 35 on 2 nodes, 105 on 4, one on 8) and each is scored on a histogram of the tokens' group sets, so the
search is exact. Node loads are the forecast's: a heavier node lifts its GPUs' mean load, which no packing inside the
node undoes, so a split may exceed balanced packing's heaviest node by `slack` of it at most.

Shape legend: T tokens, L layers, K top-k, E experts, N nodes.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from r3trace.eplb.packing import balanced_packing
from r3trace.eplb.placement import Cluster

MAX_GROUPS = 8  # 2^8 group sets a histogram; 16 groups on 4 nodes would be 2.6M splits


@cache
def even_splits(groups: int, nodes: int) -> np.ndarray:
    """Every split of `groups` groups into `nodes` unordered blocks of groups / nodes -> [S, groups] node of each
    group (blocks numbered by their lowest group)."""
    size = groups // nodes
    out: list[list[int]] = []

    def grow(node_of: list[int], counts: list[int], used: int) -> None:
        g = len(node_of)
        if g == groups:
            out.append(list(node_of))
            return
        for k in range(used + 1 if used < nodes else nodes):
            if counts[k] < size:
                counts[k] += 1
                node_of.append(k)
                grow(node_of, counts, max(used, k + 1))
                node_of.pop()
                counts[k] -= 1

    grow([], [0] * nodes, 0)
    return np.array(out, dtype=np.int64)


def group_sets(tokens: np.ndarray, num_experts: int, groups: int) -> np.ndarray:
    """tokens [T, L, K] expert ids -> [L, 2^groups] how many tokens chose each set of groups."""
    t, n_layers, _ = tokens.shape
    bits = (1 << (tokens // (num_experts // groups))).astype(np.int64)  # [T, L, K]
    mask = np.bitwise_or.reduce(bits, axis=2)  # [T, L]
    flat = mask + (np.arange(n_layers) << groups)[None, :]
    return np.bincount(flat.ravel(), minlength=n_layers << groups).reshape(n_layers, 1 << groups)


def paired_groups(weight: np.ndarray, cluster: Cluster, tokens: np.ndarray, slack: float) -> np.ndarray | None:
    """weight [L, E], tokens [T, L, K] -> [L, groups] the node of each group (module doc), or None where the nodes do
    not divide the groups into blocks of two or more, or there are more than MAX_GROUPS groups."""
    n_layers, e = weight.shape
    gr, n = cluster.num_groups, cluster.num_nodes
    if gr % n or gr == n or n == 1 or gr > MAX_GROUPS or e % gr:
        return None
    gw = weight.reshape(n_layers, gr, e // gr).sum(-1)  # [L, groups]
    pack, _ = balanced_packing(gw, n)
    rows = np.arange(n_layers)[:, None]
    base = np.zeros((n_layers, n))
    np.add.at(base, (rows, pack), gw)
    splits = even_splits(gr, n)  # [S, groups]
    load = np.zeros((n_layers, len(splits), n))  # [L, S, N]
    for g in range(gr):
        load[np.arange(n_layers)[:, None], np.arange(len(splits))[None, :], splits[None, :, g]] += gw[:, g, None]
    ok = load.max(2) <= base.max(1, keepdims=True) * (1 + slack) + 1e-9  # [L, S]
    sets = group_sets(tokens, e, gr)  # [L, 2^groups]
    members = (np.arange(1 << gr)[:, None] >> np.arange(gr)[None, :]) & 1  # [2^groups, groups]
    touched = np.zeros((len(splits), 1 << gr), dtype=np.int64)  # nodes a set of groups reaches under each split
    for k in range(n):
        touched += ((members[None, :, :] * (splits[:, None, :] == k)).sum(2) > 0)
    nodes = sets @ touched.T.astype(np.float64)  # [L, S] summed nodes over the tokens
    nodes[~ok] = np.inf
    pick = splits[np.argmin(nodes, 1)]  # [L, groups]; a balanced packing's own split is always allowed
    base_nodes = np.take_along_axis(nodes, _split_index(splits, pack)[:, None], 1)[:, 0]
    keep = np.min(nodes, 1) >= base_nodes  # no split saves a node: balanced packing's, as DeepSeek's
    return np.where(keep[:, None], pack, pick)


def _split_index(splits: np.ndarray, pack: np.ndarray) -> np.ndarray:
    """[S, groups] canonical splits, [L, groups] node of each group (any numbering) -> [L] the split each row is."""
    first = np.array([[int(np.flatnonzero(row == k)[0]) if (row == k).any() else len(row) for k in range(row.max() + 1)]
                      for row in pack])  # [L, N] lowest group on each node
    canon = np.argsort(np.argsort(first, 1, kind="stable"), 1, kind="stable")  # node -> its rank by lowest group
    relabel = np.take_along_axis(canon, pack, 1)  # [L, groups]
    eq = (relabel[:, None, :] == splits[None, :, :]).all(2)  # [L, S]
    return eq.argmax(1)
