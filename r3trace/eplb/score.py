"""Scoring a placement on routed tokens: per-GPU load and nodes per token under node-limited dispatch.

Two load models:
  even           each replica of e gets count_e / logcnt_e (EPLB's own assumption; needs only heat)
  node_limited   per token and layer the dispatcher first picks the fewest nodes that hold all its K experts
                 (exact minimum cover for N <= 8 nodes, 2^N subsets; greedy set cover above; ties broken at
                 random so no node is favoured), then splits each expert's unit of work evenly
                 over that expert's replicas on the chosen nodes. Nodes per token = the cover's size.
Shape legend: T tokens, L layers, K top-k, E experts, P slots, G GPUs, N nodes, R max replicas.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from r3trace.eplb.node_cover import chosen_nodes, flat_keys
from r3trace.eplb.placement import Cluster, Placement, replica_counts, replicas_per_node


def node_counts(pl: Placement, cluster: Cluster) -> np.ndarray:
    """Replicas per (layer, expert, node): [L, E, N]."""
    return replicas_per_node(pl.phy2log, pl.logcnt.shape[1], cluster)


def even_gpu_load(pl: Placement, heat: np.ndarray, cluster: Cluster) -> np.ndarray:
    """heat [L, E] -> per-GPU load [L, G] when every replica gets an equal share."""
    n_layers = heat.shape[0]
    per_slot = np.take_along_axis(heat / pl.logcnt, pl.phy2log, 1)  # [L, P]
    return per_slot.reshape(n_layers, cluster.num_gpus, cluster.slots_per_gpu).sum(-1)


def phy2log_gpu_load(phy2log: np.ndarray, heat: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P], heat [L, E] -> per-GPU load [L, G] under the even split: even_gpu_load of
    from_phy2log(phy2log), the same numbers, without building log2phy (1 ms a call at [58, 256])."""
    n_layers, e = heat.shape
    per_slot = np.take_along_axis(heat / replica_counts(phy2log, e), phy2log, 1)  # [L, P]
    return per_slot.reshape(n_layers, cluster.num_gpus, cluster.slots_per_gpu).sum(-1)


class Dispatch(NamedTuple):
    slot_load: np.ndarray  # [L, P] token-expert units handled per slot
    gpu_load: np.ndarray  # [L, G] the same per GPU
    nodes: np.ndarray  # [T, L] distinct nodes each token reaches
    remote: np.ndarray  # [T, L] of those, nodes other than the token's own


def node_limited(
    pl: Placement, topk_ids: np.ndarray, cluster: Cluster, token_node: np.ndarray | None = None, seed: int = 0,
    chunk: int = 2048,
) -> Dispatch:
    """topk_ids [T, L, K] -> Dispatch under greedy node cover (see module doc); token_node [T] or None.

    Works on `chunk` tokens at a time: the [T, L, K, N] masks of 8K V3 tokens on 18 nodes are 68 MB each.
    """
    parts = [
        _node_limited(pl, topk_ids[i:i + chunk], cluster,
                      None if token_node is None else token_node[i:i + chunk], seed + i)
        for i in range(0, len(topk_ids), chunk)
    ]
    slot = np.sum([p.slot_load for p in parts], axis=0)
    return Dispatch(slot, slot.reshape(len(slot), cluster.num_gpus, -1).sum(-1),
                    np.concatenate([p.nodes for p in parts]), np.concatenate([p.remote for p in parts]))


def _node_limited(
    pl: Placement, topk_ids: np.ndarray, cluster: Cluster, token_node: np.ndarray | None, seed: int
) -> Dispatch:
    t, n_layers, k = topk_ids.shape
    n = cluster.num_nodes
    cnt = node_counts(pl, cluster)  # [L, E, N]
    lrow = np.arange(n_layers)[None, :, None]
    chosen = chosen_nodes(cnt, flat_keys(topk_ids, cnt.shape[1]), n, np.random.default_rng(seed))
    # split each (token, layer, k) unit evenly over its expert's replicas on the chosen nodes: each replica on a
    # chosen node gets 1/m of it, m = the expert's replicas there. Summed per (layer, expert, node) and read back
    # per slot: [T, L, K, N] arrays instead of [T, L, K, R] ones (R = 8 on V3 at 288 slots: 2-4x less work)
    e = cnt.shape[1]
    pick = chosen[:, :, None, :]  # [T, L, 1, N]
    m = (cnt[lrow, topk_ids] * pick).sum(3, keepdims=True)  # [T, L, K, 1]
    share = pick / np.maximum(m, 1)  # [T, L, K, N] per replica on each chosen node
    cell = ((lrow * e + topk_ids) * n)[..., None] + np.arange(n)  # [T, L, K, N] flat (layer, expert, node)
    per = np.bincount(cell.ravel(), weights=share.ravel(), minlength=n_layers * e * n).reshape(n_layers, e, n)
    slot_load = per[np.arange(n_layers)[:, None], pl.phy2log, cluster.slot_node()[None, :]]  # [L, P]
    nodes = chosen.sum(2)
    if token_node is None:
        remote = nodes.copy()
    else:
        remote = nodes - np.take_along_axis(chosen, token_node[:, None, None].repeat(n_layers, 1), 2)[..., 0]
    return Dispatch(slot_load, slot_load.reshape(n_layers, cluster.num_gpus, -1).sum(-1), nodes, remote)


def balancedness(gpu_load: np.ndarray) -> float:
    """mean over layers of mean/max GPU load ([L, G] -> scalar in (0, 1]; 1 = perfectly balanced).

    SGLang's "[Expert Balancedness]" (eplb/expert_distribution.py, compute_utilization_rate), without its 1e-5
    in both terms; a layer with no load is left out here, where SGLang counts it as 1."""
    mx = gpu_load.max(1)
    ok = mx > 0
    return float((gpu_load.mean(1)[ok] / mx[ok]).mean()) if ok.any() else 1.0


def heat_of(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """topk_ids [T, L, K] -> selections per (layer, expert) [L, E]."""
    t, n_layers, _ = topk_ids.shape
    flat = topk_ids + (np.arange(n_layers) * num_experts)[None, :, None]
    counts = np.bincount(flat.ravel(), minlength=n_layers * num_experts)
    return counts.reshape(n_layers, num_experts).astype(float)
