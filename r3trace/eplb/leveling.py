"""Leveling swaps: lower the sum of squared GPU loads, not only the hottest GPU, where groups span nodes.

Why squares: with 2 slots per GPU (144 GPUs, 288 slots) the global policy pairs the heaviest replica with
the lightest, which minimises the sum of squared pair loads (rearrangement inequality), so every GPU sits
well under the max and the next window's noise rarely lifts one far above it. swap_refine (refine.py)
stops once the hottest GPU cannot be lowered and leaves many GPUs just under it: fresh 18-node plans
scored 0.835 / 0.744 / 0.535 held out (s = 0.3 / 0.6 / 1.0) with it, 0.837 / 0.749 / 0.543 with these swaps
(global 0.836 / 0.741 / 0.538).
Which swaps may cross nodes (nodes per token, s = 0.3 fresh: 5.77 with swap_refine): any pair of lone
replicas reached 0.849 but 5.96 nodes (an expert leaves its group's nodes); only within a node 0.790 and
5.55. Kept: a replica may go to a node that does not hold its expert yet when it is one of several of
its expert (extras sit on co-chosen nodes anyway), or, for an expert's only replica, when the other
expert is of the same group and both nodes held that group in the input layout (both stay on their group's
nodes) or both are cold (< `cold` x the mean slot load: rarely chosen, so their node matters little): 0.837
and 5.67 nodes, measured when "its group's nodes" followed the running layout; reading them from the input
layout instead moves the rolling 18-node rows by at most 0.001 balancedness and 0.01 nodes (BENCHMARKS.md, EPLB).

Shape legend: L layers, E experts, P slots, G GPUs, N nodes, S candidate slots (on the hottest GPUs).
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster


def level_refine(phy2log: np.ndarray, weight: np.ndarray, logcnt: np.ndarray, cluster: Cluster, max_swaps: int,
                 min_gain: float, cold: float = 0.5, hot_slots: int = 16, cross_nodes: bool = True) -> np.ndarray:
    """phy2log [L, P] -> phy2log [L, P] after at most max_swaps swaps per layer (2 moved slots each).

    weight [L, E] forecast loads, logcnt [L, E] replicas (counts do not change). Each step swaps a slot of
    one of the layer's hottest GPUs (as many as hold about `hot_slots` slots: 8 of 2 slots on 144 GPUs, 1 of 9
    on 32; 8 GPUs of 9 slots made a [58, 256] plan take 3 s) with any slot of another GPU, the allowed pair (module doc)
    that lowers the sum of squared GPU loads most; a layer stops once that gain is below
    min_gain x (mean GPU load)^2. cross_nodes=False keeps every replica on its node (swaps inside nodes only).
    """
    out = np.asarray(phy2log, dtype=np.int64).copy()
    n_layers, p = out.shape
    e, n_nodes, spg = weight.shape[1], cluster.num_nodes, cluster.slots_per_gpu
    gsize = e // cluster.num_groups
    slot_gpu, slot_node = cluster.slot_gpu(), cluster.slot_node()
    per_rep = weight / logcnt
    u = np.take_along_axis(per_rep, out, 1)  # [L, P] load of each slot
    lone = np.take_along_axis(logcnt, out, 1) == 1  # [L, P] counts are fixed, so this moves with the expert
    mean = weight.sum(1) / cluster.num_gpus  # [L]
    floor = min_gain * mean**2
    cold_slot = cold * mean / spg  # [L]
    cnt = np.zeros((n_layers, e, n_nodes), dtype=np.int64)
    np.add.at(cnt, (np.arange(n_layers)[:, None], out, slot_node[None, :]), 1)
    mask_t = next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64) if np.iinfo(t).bits >= n_nodes)
    bit = (np.uint64(1) << np.arange(n_nodes, dtype=np.uint64)).astype(mask_t)  # [N]: node k is bit k (N <= 64)
    node16, gpu16 = np.arange(n_nodes, dtype=np.int16), np.arange(cluster.num_gpus, dtype=np.int16)
    nodes_of = ((cnt > 0) * bit).sum(2, dtype=mask_t)  # [L, E] bitmask of the nodes holding each expert
    # [L, groups] bitmask of the nodes holding each group in the input: "its group's nodes" for a lone replica. Taken
    # from the running layout instead, a chain of swaps in one call could carry a hot lone expert to a node its group
    # had reached only through an earlier swap of a replica (seen in 1 of 300 random layouts of 18 nodes)
    group_nodes = np.zeros((n_layers, cluster.num_groups), dtype=mask_t)
    np.bitwise_or.at(group_nodes, (np.arange(n_layers)[:, None], out // gsize), bit[slot_node][None, :])
    hot_gpus = max(1, hot_slots // spg)
    gpn = cluster.gpus_per_node
    cold_gpus = min(cluster.num_gpus, max(1, 4 * hot_slots // spg))
    r = np.arange(n_layers)  # layers still improving
    for _ in range(max_swaps):
        n = len(r)
        at = np.arange(n)[:, None]
        ur, o, lo = u[r], out[r], lone[r]
        gpu = ur.reshape(n, cluster.num_gpus, spg).sum(-1)  # [n, G]
        rank = np.argsort(-gpu, axis=1)
        hot = rank[:, :hot_gpus]
        mine = (hot[:, :, None] * spg + np.arange(spg)).reshape(n, -1)  # [n, S]
        # partners: the coldest GPUs anywhere and every GPU of the hottest GPU's node (swaps inside a node are
        # always allowed); all P slots made each step [n, S, P] and a [58, 256] plan on 8 nodes take 1 s
        near = (hot[:, :1] // gpn) * gpn + np.arange(gpn)  # [n, gpn]
        part = np.concatenate([rank[:, -cold_gpus:], near], 1)  # [n, B / spg]
        bs = (part[:, :, None] * spg + np.arange(spg)).reshape(n, -1)  # [n, B] candidate slots
        b_gpu, b_node = slot_gpu[bs], slot_node[bs]  # [n, B]
        a_gpu, a_node = slot_gpu[mine], slot_node[mine]
        ga = np.take_along_axis(gpu, a_gpu, 1)[:, :, None]  # [n, S, 1]
        gb = np.take_along_axis(gpu, b_gpu, 1)[:, None, :]  # [n, 1, B]
        d = ur[at, mine][:, :, None] - ur[at, bs][:, None, :]  # [n, S, B] load moved from a's GPU to b's
        gain = ga - gb  # drop of ga^2 + gb^2: 2d (ga - gb) - 2d d, in place on the [n, S, B] arrays
        d2 = 2 * d
        gain *= d2
        d2 *= d
        gain -= d2
        # [n, S, B] masks in the smallest dtypes (node bitmasks uint8 on <= 8 nodes): 2x less time per step
        held_a = nodes_of[r[:, None], o[at, mine]]  # [n, S] node bitmask of a's expert
        held_b = nodes_of[r[:, None], o[at, bs]]  # [n, B]
        x_at_b = (held_a[:, :, None] & bit[b_node][:, None, :]) != 0  # [n, S, B] a's expert on b's node
        y_at_a = (held_b[:, None, :] & bit[a_node][:, :, None]) != 0  # [n, S, B] b's expert on a's node
        la, lb = lo[at, mine][:, :, None], lo[at, bs][:, None, :]
        g_a = (o[at, mine] // gsize).astype(np.int16)  # [n, S] group of a's expert
        home = group_nodes[r[:, None], g_a]  # [n, S] the nodes that group held in the input
        kin = g_a[:, :, None] == (o[at, bs] // gsize).astype(np.int16)[:, None, :]
        kin &= (home[:, :, None] & bit[b_node][:, None, :]) != 0
        kin &= ((home & bit[a_node]) != 0)[:, :, None]  # one group, both nodes among its input nodes
        cold_b = ur < cold_slot[r, None]
        kin |= cold_b[at, mine][:, :, None] & cold_b[at, bs][:, None, :]
        cross = ~(x_at_b | y_at_a) & ((~la & ~lb) | kin) & cross_nodes
        ok = (node16[a_node][:, :, None] == node16[b_node][:, None, :]) | cross
        ok &= gpu16[a_gpu][:, :, None] != gpu16[b_gpu][:, None, :]
        flat = np.where(ok, gain, -np.inf).reshape(n, -1)
        best = np.argmax(flat, axis=1)
        keep = flat[np.arange(n), best] > floor[r]
        if not keep.any():
            break
        i, j = np.divmod(best[keep], bs.shape[1])
        b = bs[keep, j]
        r = r[keep]
        a = mine[keep, i]
        xa, yb = out[r, a], out[r, b]
        np.add.at(cnt, (r, xa, slot_node[a]), -1)
        np.add.at(cnt, (r, yb, slot_node[b]), -1)
        np.add.at(cnt, (r, xa, slot_node[b]), 1)
        np.add.at(cnt, (r, yb, slot_node[a]), 1)
        nodes_of[r, xa] = ((cnt[r, xa] > 0) * bit).sum(1, dtype=mask_t)
        nodes_of[r, yb] = ((cnt[r, yb] > 0) * bit).sum(1, dtype=mask_t)
        out[r, a], out[r, b] = yb, xa
        u[r, a], u[r, b] = u[r, b], u[r, a].copy()
        lone[r, a], lone[r, b] = lone[r, b], lone[r, a].copy()
    return out
