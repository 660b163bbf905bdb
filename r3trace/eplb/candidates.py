"""Per layer, the best of three layouts on the forecast: ours, DeepSeek's global policy with its GPUs grouped onto
nodes, and global's plan as it is. Used where ours' layout would otherwise be kept whatever it costs: fresh plans
without a spare slot (P = E) and the fresh plan a drifting workload re-plans to (planner.plan).

The lowest forecast max GPU load wins; within MAX_LOAD_TIE of it, the fewest nodes per token. With one replica per
expert (P = E) a token's nodes are exactly the distinct nodes of its K experts, so they are counted on the newest
tokens (predicting the next window's to 0.01 on bench/eplb_matrix.py's 128x16x256 cells); with replicas the cover
is the dispatcher's choice, so ties go to ours, then global grouped, then global. Why global is a candidate: on
bench/eplb_matrix.py's cells it balances some layers better than ours on the same forecast, in sample and held out
(independent router, s = 1.2, fast drift, 32x4x288: 0.997 vs 0.989 in sample, 0.801 vs 0.778 on the next window),
and at high skew without spare slots its packing puts the hottest experts, one per GPU, on the first nodes (5.61
nodes per token against ours' 6.24 at s = 0.9 on 16 nodes). Reordering whole GPUs (by_group) keeps every GPU's
load, so it changes nodes per token only. Shape legend: T tokens, L layers, K top-k, E experts, P slots, G GPUs.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.deepseek import global_policy
from r3trace.eplb.placement import Cluster
from r3trace.eplb.score import phy2log_gpu_load

# a candidate whose forecast max GPU load is within this share of the lowest counts as balanced as it (the
# forecast's own sampling noise is larger); then nodes per token decide
MAX_LOAD_TIE = 0.002


def by_group(phy2log: np.ndarray, num_experts: int, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] -> the same GPUs' slot sets with GPUs ordered by the group most of their slots hold (the
    purest first), so consecutive GPUs, and so nodes, hold one group's experts."""
    n_layers = phy2log.shape[0]
    gpus = phy2log.reshape(n_layers, cluster.num_gpus, cluster.slots_per_gpu)  # [L, G, P/G]
    grp = gpus // (num_experts // cluster.num_groups)
    share = np.zeros((n_layers, cluster.num_gpus, cluster.num_groups))
    np.add.at(share, (np.arange(n_layers)[:, None, None], np.arange(cluster.num_gpus)[None, :, None], grp), 1.0)
    key = share.argmax(2) * (cluster.slots_per_gpu + 1) - share.max(2)  # [L, G] dominant group, purest first
    order = np.argsort(key, axis=1, kind="stable")
    return np.take_along_axis(gpus, order[:, :, None], 1).reshape(n_layers, -1)


def nodes_per_token(phy2log: np.ndarray, tokens: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] with every expert once, tokens [T, L, K] -> [L] mean distinct nodes of a token's experts."""
    return _distinct_nodes(phy2log, _flat_ids(tokens, phy2log.shape[1]), cluster)


def _flat_ids(tokens: np.ndarray, num_experts: int) -> np.ndarray:
    """tokens [T, L, K] -> [T, L, K] indices into an [L, E] array raveled."""
    return tokens.astype(np.intp) + (np.arange(tokens.shape[1]) * num_experts)[None, :, None]


def _distinct_nodes(phy2log: np.ndarray, flat: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] with every expert once, flat [T, L, K] (_flat_ids) -> [L] mean distinct nodes a token.

    A token's nodes are the set bits of the OR of its experts' node bits (N <= 64; more nodes: a sort over K): at
    [58, 256] on 8 nodes ~3 ms a candidate against 13 ms for sorting the [T, L, K] node ids."""
    n_layers = phy2log.shape[0]
    node_of = np.empty_like(phy2log)
    node_of[np.arange(n_layers)[:, None], phy2log] = cluster.slot_node()[None, :]  # [L, E]
    if cluster.num_nodes > 64:
        nodes = np.sort(np.take(node_of, flat), axis=2)  # [T, L, K]
        return (1 + (np.diff(nodes, axis=2) != 0).sum(2)).mean(0)
    mask_t = next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64) if np.iinfo(t).bits >= cluster.num_nodes)
    picked = np.take(np.left_shift(1, node_of.astype(np.uint64)).astype(mask_t), flat)  # [T, L, K] node bits
    cover = picked[:, :, 0].copy()  # [T, L] OR over K, one position at a time (a reduce over the short axis: 4x slower)
    for k in range(1, picked.shape[2]):
        cover |= picked[:, :, k]
    return np.bitwise_count(cover).astype(np.int64).mean(0)


def best_layout(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, tokens: np.ndarray | None) -> np.ndarray:
    """Ours' phy2log [L, P], forecast w [L, E], newest tokens [T, L, K] or None -> phy2log [L, P], per layer the
    candidate of the module doc with the lowest max GPU load up to MAX_LOAD_TIE, then the fewest nodes per token."""
    e = w.shape[1]
    glob = global_policy(w, cluster).phy2log
    cands = np.stack([phy2log, by_group(glob, e, cluster), glob])  # [3, L, P]
    peak = np.stack([phy2log_gpu_load(c, w, cluster).max(1) for c in cands])  # [3, L]
    tied = peak <= peak.min(0) * (1 + MAX_LOAD_TIE)
    cost = np.broadcast_to(np.arange(len(cands), dtype=np.float64)[:, None], peak.shape).copy()
    need = tied.sum(0) > 1  # [L] layers where nodes per token decide (a lone candidate within the tie wins)
    if tokens is not None and cluster.num_slots == e and need.any():
        flat = _flat_ids(tokens[:, need], e)
        cost[:, need] = np.stack([_distinct_nodes(c[need], flat, cluster) for c in cands])
    pick = np.argmin(np.where(tied, cost, np.inf), axis=0)  # [L]
    return cands[pick, np.arange(len(pick))]
