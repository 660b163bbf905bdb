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

from r3trace.eplb.placement import Cluster, Placement


def node_counts(pl: Placement, cluster: Cluster) -> np.ndarray:
    """Replicas per (layer, expert, node): [L, E, N]."""
    n_layers, e = pl.logcnt.shape
    node = np.broadcast_to(cluster.slot_node(), pl.phy2log.shape)  # [L, P]
    cnt = np.zeros((n_layers, e, cluster.num_nodes), dtype=np.int64)
    np.add.at(cnt, (np.arange(n_layers)[:, None], pl.phy2log, node), 1)
    return cnt


def even_gpu_load(pl: Placement, heat: np.ndarray, cluster: Cluster) -> np.ndarray:
    """heat [L, E] -> per-GPU load [L, G] when every replica gets an equal share."""
    n_layers = heat.shape[0]
    per_slot = np.take_along_axis(heat / pl.logcnt, pl.phy2log, 1)  # [L, P]
    return per_slot.reshape(n_layers, cluster.num_gpus, cluster.slots_per_gpu).sum(-1)


def phy2log_gpu_load(phy2log: np.ndarray, heat: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P], heat [L, E] -> per-GPU load [L, G] under the even split: even_gpu_load of
    from_phy2log(phy2log), the same numbers, without building log2phy (1 ms a call at [58, 256])."""
    n_layers, e = heat.shape
    cnt = np.bincount((phy2log + (np.arange(n_layers) * e)[:, None]).ravel(), minlength=n_layers * e)
    per_slot = np.take_along_axis(heat / cnt.reshape(n_layers, e), phy2log, 1)  # [L, P]
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
    rng = np.random.default_rng(seed)
    cnt = node_counts(pl, cluster)  # [L, E, N]
    lrow = np.arange(n_layers)[None, :, None]
    if n <= EXACT_COVER_NODES:  # node bitmask per (layer, expert), gathered per token: 1 byte, not N bools
        ebits = ((cnt > 0).astype(np.uint16) << np.arange(n, dtype=np.uint16)).sum(-1, dtype=np.uint16)
        chosen = _min_cover(ebits.astype(np.uint8)[lrow, topk_ids], n, rng)
    else:
        chosen = _greedy_cover(cnt[lrow, topk_ids] > 0, rng)  # has [T, L, K, N]
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


EXACT_COVER_NODES = 8  # 255 subsets: exact; 18 nodes would be 262K subsets, so greedy there


def _min_cover(bits: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """bits [T, L, K] uint8 node bitmask of each expert (N <= 8 nodes) -> chosen [T, L, N]: a smallest node set
    covering all K experts, ties broken by one random draw per (subset, token, layer)."""
    t, n_layers, k = bits.shape
    masks = ((np.arange(1, 2**n)[:, None] >> np.arange(n)) & 1).astype(bool)  # [S, N]
    size = masks.sum(1)
    best = np.full((t, n_layers), -1)
    best_score = np.full((t, n_layers), np.inf)
    hit = np.empty_like(bits, dtype=bool)
    for s in np.argsort(size, kind="stable"):
        np.not_equal(np.bitwise_and(bits, np.uint8(s + 1)), 0, out=hit)  # subset s is the bitmask s + 1
        covers = hit.all(-1)  # [T, L]
        score = np.where(covers, size[s] + rng.random((t, n_layers)) * 0.5, np.inf)
        better = score < best_score
        np.copyto(best, s, where=better)
        np.copyto(best_score, score, where=better)
    return masks[np.maximum(best, 0)] & (best >= 0)[..., None]


def _greedy_cover(has: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """has [T, L, K, N] -> chosen [T, L, N]: greedy set cover, most uncovered experts first."""
    t, n_layers, k, n = has.shape
    uncovered = np.ones((t, n_layers, k), dtype=bool)
    chosen = np.zeros((t, n_layers, n), dtype=bool)
    jitter = rng.random((t, n_layers, n)) * 0.5  # breaks ties between equal gains only
    for _ in range(k):
        gain = (has & uncovered[..., None]).sum(2)  # [T, L, N]
        if not gain.any():
            break
        best = np.argmax(gain + jitter, axis=2)  # [T, L]
        active = np.take_along_axis(gain, best[..., None], 2)[..., 0] > 0
        chosen[np.arange(t)[:, None], np.arange(n_layers)[None, :], best] |= active
        took = np.take_along_axis(has, best[..., None, None].repeat(k, 2), 3)[..., 0]  # [T, L, K]
        uncovered &= ~(took & active[..., None])
    return chosen


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
