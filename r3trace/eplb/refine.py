"""Bounded local search on a placement: swap two slots of one node to lower the hottest GPU.

Used after a fresh plan (LPT leaves a few points of in-sample balance) and, with a small budget, on the
previous placement when a re-plan keeps it: each swap moves two replicas, so `max_swaps` bounds the churn
of a re-plan at 2 * max_swaps / P of the slots. Swaps keep one node per expert (homing.py): inside a node,
or across nodes between two experts with a single replica each. On 144 GPUs (2 slots per GPU) the pairs
inside one node leave little to swap; crossing nodes is what lets a swap pair a hot replica with a cold one.

Shape legend: L layers, E experts, P slots, G GPUs.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster

# candidate pairs ([layers, spg, P] float64 arrays) swap_refine handles at once, 1 MB: on one node (36 slots a GPU)
# all 58 layers' were 4.8 MB a step and the re-plan at [58, 288] took ~5,000 page faults
REFINE_BLOCK = 1 << 17


def swap_refine(phy2log: np.ndarray, weight: np.ndarray, logcnt: np.ndarray, cluster: Cluster, max_swaps: int,
                min_gain: float, cross_nodes: bool = True) -> np.ndarray:
    """phy2log [L, P] -> phy2log [L, P] after at most max_swaps swaps per layer.

    weight [L, E] forecast loads, logcnt [L, E] replicas. Each step swaps one slot of the layer's hottest
    GPU with one slot of another GPU of the same node (or of any node when both slots hold an expert's only
    replica, so every expert still has one node; never with cross_nodes=False), choosing the pair that
    lowers the larger of the two GPUs' loads most; a layer stops once the best swap gains less than
    min_gain x its mean GPU load. Layers are independent: they go REFINE_BLOCK candidate pairs at a time.
    """
    n_layers, p = phy2log.shape
    step = max(1, REFINE_BLOCK // (cluster.slots_per_gpu * p))
    if n_layers > step:
        return np.concatenate([swap_refine(phy2log[a:a + step], weight[a:a + step], logcnt[a:a + step], cluster,
                                           max_swaps, min_gain, cross_nodes) for a in range(0, n_layers, step)])
    out = phy2log.copy()
    spg, gpn = cluster.slots_per_gpu, cluster.gpus_per_node
    rows = np.arange(n_layers)
    slot_gpu, slot_node = cluster.slot_gpu(), cluster.slot_node()
    single = (np.take_along_axis(logcnt, out, 1) == 1) & cross_nodes  # [L, P]: a lone replica may change node
    u = np.take_along_axis(weight / logcnt, out, 1)  # [L, P] load of each slot
    floor = min_gain * weight.sum(1) / cluster.num_gpus  # [L]
    r = rows  # layers still improving; the others are dropped from the [*, spg, P] work
    for _ in range(max_swaps):
        ur = u[r]
        gpu = ur.reshape(len(r), cluster.num_gpus, spg).sum(-1)  # [l, G]
        g = np.argmax(gpu, axis=1)  # [l]
        mine = (g * spg)[:, None] + np.arange(spg)  # [l, spg] slots of the hottest GPU
        at = np.arange(len(r))[:, None]
        d = ur[at, mine][:, :, None] - ur[:, None, :]  # [l, spg, P]
        top = gpu[at[:, 0], g][:, None, None]
        gain = top - np.maximum(top - d, gpu[:, slot_gpu][:, None, :] + d)
        same_node = (slot_node[None, :] == (g // gpn)[:, None])[:, None, :]  # [l, 1, P]
        singles = single[r[:, None], mine][:, :, None] & single[r][:, None, :]  # [l, spg, P]
        ok = (same_node | singles) & (slot_gpu[None, :] != g[:, None])[:, None, :]
        flat = np.where(ok, gain, -np.inf).reshape(len(r), -1)
        best = np.argmax(flat, axis=1)
        keep = flat[at[:, 0], best] > floor[r]
        if not keep.any():
            break
        i, j = np.divmod(best[keep], p)
        r, a, b = r[keep], mine[keep, i], j
        out[r, a], out[r, b] = out[r, b], out[r, a].copy()
        u[r, a], u[r, b] = u[r, b], u[r, a].copy()
        single[r, a], single[r, b] = single[r, b], single[r, a].copy()
    return out
