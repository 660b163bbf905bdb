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
layout instead moved 18-node plans by at most 0.001 balancedness and 0.01 nodes per token.

Shape legend: L layers, E experts, P slots, G GPUs, N nodes, S candidate slots (on the hottest GPUs).
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster, PlacementError


def level_refine(phy2log: np.ndarray, weight: np.ndarray, logcnt: np.ndarray, cluster: Cluster, max_swaps: int,
                 min_gain: float, cold: float = 0.5, hot_slots: int = 16, cross_nodes: bool = True) -> np.ndarray:
    """phy2log [L, P] -> phy2log [L, P] after at most max_swaps swaps per layer (2 moved slots each).

    weight [L, E] forecast loads, logcnt [L, E] replicas (counts do not change). Each step swaps a slot of
    one of the layer's hottest GPUs (as many as hold about `hot_slots` slots: 8 of 2 slots on 144 GPUs, 1 of 9
    on 32; 8 GPUs of 9 slots made a [58, 256] plan take 3 s) with any slot of another GPU, the allowed pair (module doc)
    that lowers the sum of squared GPU loads most; a layer stops once that gain is below
    min_gain x (mean GPU load)^2. cross_nodes=False keeps every replica on its node (swaps inside nodes only).
    """
    if min_gain < 0:
        raise PlacementError(f"min_gain={min_gain} must be >= 0")
    out = np.asarray(phy2log, dtype=np.int64).copy()
    n_layers, p = out.shape
    e, n_nodes, spg = weight.shape[1], cluster.num_nodes, cluster.slots_per_gpu
    gsize = e // cluster.num_groups
    slot_node = cluster.slot_node()
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
    nodes_of = ((cnt > 0) * bit).sum(2, dtype=mask_t)  # [L, E] bitmask of the nodes holding each expert
    # [L, groups] bitmask of the nodes holding each group in the input: "its group's nodes" for a lone replica. Taken
    # from the running layout instead, a chain of swaps in one call could carry a hot lone expert to a node its group
    # had reached only through an earlier swap of a replica (seen in 1 of 300 random layouts of 18 nodes)
    group_nodes = np.zeros((n_layers, cluster.num_groups), dtype=mask_t)
    np.bitwise_or.at(group_nodes, (np.arange(n_layers)[:, None], out // gsize), bit[slot_node][None, :])
    hot_gpus = max(1, hot_slots // spg)
    gpn, n_gpus = cluster.gpus_per_node, cluster.num_gpus
    cold_gpus = min(n_gpus, max(1, 4 * hot_slots // spg))
    in_gpu, in_node = np.arange(spg), np.arange(gpn)
    slot_gpu16, slot_node16 = cluster.slot_gpu().astype(np.int16), slot_node.astype(np.int16)
    buf_d, buf_gain = (np.empty((n_layers, hot_gpus * spg, (cold_gpus + gpn) * spg)) for _ in range(2))
    gpu_all = u.reshape(n_layers, n_gpus, spg).sum(-1)  # [L, G]; a swap re-sums its two GPUs' rows (same sums)
    r = np.arange(n_layers)  # layers still improving
    for _ in range(max_swaps):
        n = len(r)
        ur, o, lo, gpu = (u, out, lone, gpu_all) if n == n_layers else (u[r], out[r], lone[r], gpu_all[r])
        rank = np.argsort(-gpu, axis=1)
        hot = rank[:, :hot_gpus]
        mine = (hot[:, :, None] * spg + in_gpu).reshape(n, -1)  # [n, S]
        # partners: the coldest GPUs anywhere and every GPU of the hottest GPU's node (swaps inside a node are
        # always allowed); all P slots made each step [n, S, P] and a [58, 256] plan on 8 nodes take 1 s
        near = (hot[:, :1] // gpn) * gpn + in_node  # [n, gpn]
        part = np.concatenate([rank[:, -cold_gpus:], near], 1)  # [n, B / spg]
        bs = (part[:, :, None] * spg + in_gpu).reshape(n, -1)  # [n, B] candidate slots
        # per-slot values are gathered once for a's and b's slots together ([n, S + B]) and meet in [n, S, B] only
        # by broadcasting, in the smallest dtypes: at [58, 320] a step is ~20 passes over 87K pairs
        ab, ns = np.concatenate([mine, bs], 1), mine.shape[1]
        flat_ab = ab + (np.arange(n) * p)[:, None]  # [n, S + B] into the [n, P] arrays, raveled
        u_ab = np.take(ur, flat_ab)
        g_ab = np.take(gpu, ab // spg + (np.arange(n) * n_gpus)[:, None])
        # the drop of ga^2 + gb^2 when d moves from a's GPU to b's is 2 (d (ga - gb) - d d); `gain` holds half of it
        # (doubling is exact in binary floating point, so the comparisons below are those of the full drop). The
        # [n, S, B] float arrays live in buffers made once: fresh ones were page-faulted in on every step
        d, gain = buf_d[:n], buf_gain[:n]
        # [n, S, B] load moved from a's GPU to b's; a's side copied in first (one broadcast operand per op: 25% faster)
        np.copyto(d, u_ab[:, :ns, None])
        d -= u_ab[:, None, ns:]
        np.copyto(gain, g_ab[:, :ns, None])
        gain -= g_ab[:, None, ns:]
        gain *= d
        d *= d
        gain -= d
        gpu_ab, node_ab = slot_gpu16[ab], slot_node16[ab]
        ok = gpu_ab[:, :ns, None] != gpu_ab[:, None, ns:]  # [n, S, B] a swap inside one GPU changes nothing
        same_node = node_ab[:, :ns, None] == node_ab[:, None, ns:]
        if cross_nodes:  # allowed: inside a node, or across nodes as the module doc says
            o_ab = np.take(o, flat_ab)  # [n, S + B] experts
            bit_ab = bit[node_ab]
            bit_a, bit_b = bit_ab[:, :ns, None], bit_ab[:, None, ns:]
            held = np.take(nodes_of, o_ab + (r * e)[:, None])  # [n, S + B] node bitmask of each slot's expert
            grp = (o_ab // gsize).astype(np.int16)
            # one group, both nodes among the nodes it held in the input: a slot whose node its group did not hold
            # gets group -1 (a's side) or -2 (b's side), so one [n, S, B] comparison decides
            at_home = (np.take(group_nodes, grp + (r * cluster.num_groups)[:, None]) & bit_ab) != 0  # [n, S + B]
            grp[:, :ns][~at_home[:, :ns]] = -1
            grp[:, ns:][~at_home[:, ns:]] = -2
            kin = grp[:, :ns, None] == grp[:, None, ns:]
            # bit 0: a cold slot, bit 1: a replica of an expert with several: both cold or both not lone
            flag = (u_ab < cold_slot[r, None]).view(np.uint8) | (~np.take(lo, flat_ab)).view(np.uint8) << 1
            kin |= (flag[:, :ns, None] & flag[:, None, ns:]) != 0
            # ... and neither expert already on the other's node (the swap would merge its replicas)
            kin &= ((held[:, :ns, None] & bit_b) | (held[:, None, ns:] & bit_a)) == 0
            same_node |= kin
        ok &= same_node
        gain *= ok
        flat = gain.reshape(n, -1)
        best = np.argmax(flat, axis=1)
        keep = 2 * flat[np.arange(n), best] > floor[r]
        if not keep.any():
            break
        i, j = np.divmod(best[keep], bs.shape[1])
        b = bs[keep, j]
        r = r[keep]
        a = mine[keep, i]
        xa, yb = out[r, a], out[r, b]
        # one swap per layer, of two different experts (a positive gain needs d != 0): no index repeats in a statement
        cnt[r, xa, slot_node[a]] -= 1
        cnt[r, yb, slot_node[b]] -= 1
        cnt[r, xa, slot_node[b]] += 1
        cnt[r, yb, slot_node[a]] += 1
        nodes_of[r, xa] = ((cnt[r, xa] > 0) * bit).sum(1, dtype=mask_t)
        nodes_of[r, yb] = ((cnt[r, yb] > 0) * bit).sum(1, dtype=mask_t)
        out[r, a], out[r, b] = yb, xa
        u[r, a], u[r, b] = u[r, b], u[r, a].copy()
        lone[r, a], lone[r, b] = lone[r, b], lone[r, a].copy()
        u3 = u.reshape(n_layers, n_gpus, spg)
        gpu_all[r, a // spg] = u3[r, a // spg].sum(-1)
        gpu_all[r, b // spg] = u3[r, b // spg].sum(-1)
    return out
