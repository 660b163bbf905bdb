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
layout instead moved 18-node plans by at most 0.001 balancedness and 0.01 nodes per token. With one group
(a router without groups) every node holds it, so that rule would let any two lone replicas trade nodes; without
a spare slot (P = E) only cold ones cross there (bench/eplb_matrix.py, 128 GPUs / 16 nodes / 256 slots, one
group, re-plans: nodes per token 5.31 -> 4.62 at s = 1.2 with the independent router, 4.88 -> 4.81 clustered,
balancedness equal). With spare slots the rule stays: there it cost 0.005-0.012 balancedness held out (16 GPUs
/ 2 nodes / 288 slots) and gained no nodes per token.

Shape legend: L layers, E experts, P slots, G GPUs, N nodes, S candidate slots (on the hottest GPUs).
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster, PlacementError, replicas_per_node


def level_refine(phy2log: np.ndarray, weight: np.ndarray, logcnt: np.ndarray, cluster: Cluster,
                 max_swaps: int | np.ndarray,
                 min_gain: float, cold: float | np.ndarray = 0.5, hot_slots: int = 16, cross_nodes: bool = True,
                 out_of_reach: np.ndarray | None = None, spread: np.ndarray | None = None) -> np.ndarray:
    """phy2log [L, P] -> phy2log [L, P] after at most max_swaps swaps per layer (2 moved slots each): one for every
    layer, or [L] each layer's own (a layer's swaps are the same as in a call with its count for every layer).

    weight [L, E] forecast loads, logcnt [L, E] replicas (counts do not change); cold: the module doc's factor, or
    [L] one per layer (inf: every replica counts as cold, so any two may cross nodes). Each step swaps a slot of
    one of the layer's hottest GPUs (as many as hold about `hot_slots` slots: 8 of 2 slots on 144 GPUs, 1 of 9
    on 32; 8 GPUs of 9 slots made a [58, 256] plan take 3 s) with any slot of another GPU, the allowed pair (module doc)
    that lowers the sum of squared GPU loads most; a layer stops once that gain is below
    min_gain x (mean GPU load)^2. cross_nodes=False keeps every replica on its node (swaps inside nodes only).

    out_of_reach [L] or None: a layer also stops, where its swaps could no longer bring its max GPU load down to
    out_of_reach or below, for a caller that has no use for such a layer (candidates.Contest: ours loses there).
    A swap lowers one GPU's load and raises the other's (each a sum of the same slot loads in the same order but
    one, so also in floating point), so with m swaps left the (m + 1)-th hottest GPU's load is a floor under the
    final max load; a layer stops once that floor exceeds out_of_reach, its max load then above it too.

    spread [R, L, E] or None: load deviations whose squares sum to each expert's variance (scenarios.spread); the swaps
    then lower the expected sum of squared GPU loads, the squared forecast loads plus every GPU's load variance.
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
    if spread is not None:  # the product's rounding (below) gives pairs on one GPU ~1e-16 x mean^2, not 0: never a swap
        floor = np.maximum(floor, 1e-12 * mean**2)
    cold_slot = cold * mean / spg  # [L]
    cnt = replicas_per_node(out, e, cluster)  # [L, E, N] replicas of each expert on each node
    mask_t = next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64) if np.iinfo(t).bits >= n_nodes)
    bit = (np.uint64(1) << np.arange(n_nodes, dtype=np.uint64)).astype(mask_t)  # [N]: node k is bit k (N <= 64)
    nodes_of = ((cnt > 0) * bit).sum(2, dtype=mask_t)  # [L, E] bitmask of the nodes holding each expert
    # [L, groups] bitmask of the nodes holding each group in the input: "its group's nodes" for a lone replica. Taken
    # from the running layout instead, a chain of swaps in one call could carry a hot lone expert to a node its group
    # had reached only through an earlier swap of a replica (seen in 1 of 300 random layouts of 18 nodes)
    n_gr = cluster.num_groups
    on = np.bincount(((np.arange(n_layers)[:, None] * n_gr + out // gsize) * n_nodes + slot_node).ravel(),
                     minlength=n_layers * n_gr * n_nodes).reshape(n_layers, n_gr, n_nodes) > 0
    group_nodes = (on * bit).sum(2, dtype=mask_t)  # [L, groups]
    if cluster.num_groups == 1 and p == e:  # one group spans every node, so "both on its group's nodes" would
        # hold for any two lone experts (module doc); with spare slots those swaps kept their balancedness gains
        group_nodes[:] = 0
    hot_gpus = min(cluster.num_gpus, max(1, hot_slots // spg))  # a small cluster has fewer GPUs than hot_slots asks
    gpn, n_gpus = cluster.gpus_per_node, cluster.num_gpus
    cold_gpus = min(n_gpus, max(1, 4 * hot_slots // spg))
    in_gpu, in_node = np.arange(spg), np.arange(gpn)
    slot_node16, slot_bit = slot_node.astype(np.int16), bit[slot_node]
    # one hot GPU: b's near GPUs leave it out (a pair on one GPU never gains: ga = gb, gain -d d, so the same swaps),
    # and they all share its node, so only the cold GPUs' columns need the node rule (16 GPUs / 2 nodes / 288 slots:
    # 54 of 180 columns; with all 198 ruled the leveling there was a quarter of a drifting re-plan's time)
    one_hot = hot_gpus == 1
    n_near = gpn - 1 if one_hot else gpn
    ruled = cold_gpus * spg if one_hot else (cold_gpus + gpn) * spg  # b's columns the node rule decides, first
    # [L, S, B] float buffers of the gains (one hot GPU: [L, S, cold GPUs' slots], _one_hot_best)
    width = cold_gpus * spg if one_hot and spread is None else (cold_gpus + n_near) * spg
    buf_d, buf_gain = (np.empty((n_layers, hot_gpus * spg, width)) for _ in range(2))
    gpu_all = u.reshape(n_layers, n_gpus, spg).sum(-1)  # [L, G]; a swap re-sums its two GPUs' rows (same sums)
    # per-slot codes of the cross-node rule, kept up to date by each swap instead of re-derived each step:
    # flag bit 0: a cold slot, bit 1: a replica of an expert with several (both move with the expert);
    # group: the expert's group where its group held the slot's node in the input, else -1 on a's side and -2 on
    # b's, so one comparison of a's and b's codes says "one group, both at home"
    flag = (u < cold_slot[:, None]).view(np.uint8) | (~lone).view(np.uint8) << 1  # [L, P]
    grp_a = _home_group(out, slot_bit[None, :], group_nodes, gsize, np.arange(n_layers)[:, None])  # [L, P]
    grp_b = np.where(grp_a < 0, np.int16(-2), grp_a)
    r = np.arange(n_layers)  # layers still improving
    # raveled views of the per-slot, per-expert and per-GPU state (reshape without copy: writes reach the arrays)
    out_flat, u_flat, flag_flat = (np.reshape(x, -1, copy=False) for x in (out, u, flag))
    grp_a_flat, grp_b_flat = np.reshape(grp_a, -1, copy=False), np.reshape(grp_b, -1, copy=False)
    cnt_rows, nodes_of_flat = np.reshape(cnt, (-1, n_nodes), copy=False), np.reshape(nodes_of, -1, copy=False)
    gpu_all_flat, u_gpus = np.reshape(gpu_all, -1, copy=False), np.reshape(u, (-1, spg), copy=False)
    if spread is not None:  # [L P, R] slot and [L G, R] GPU loads, the forecast's then each deviation's, kept up to
        # date by the swaps
        cols = np.concatenate([weight[None], spread])
        n_dev = len(cols)
        u_dev = np.take_along_axis(cols / logcnt[None], np.broadcast_to(out, (n_dev, *out.shape)), 2)
        g_dev = np.moveaxis(u_dev.reshape(n_dev, n_layers * n_gpus, spg).sum(-1), 0, -1).copy()
        u_dev = np.moveaxis(u_dev.reshape(n_dev, -1), 0, -1).copy()
        buf_a = np.empty((n_layers, hot_gpus * spg, 2 * n_dev + 2))  # [ua, -ga, ua (ga - ua), 1]
        buf_b = np.empty((n_layers, 2 * n_dev + 2, buf_d.shape[2]))  # [2 ub - gb, ub, 1, ub (gb - ub)]
        buf_a[:, :, -1], buf_b[:, -2] = 1.0, 1.0
    caps = np.broadcast_to(np.asarray(max_swaps, dtype=np.int64), (n_layers,))  # [L] swaps each layer may take
    for step in range(int(caps.max(initial=0))):
        if caps[r].min() <= step:  # layers whose swaps are spent leave
            r = r[caps[r] > step]
        n = len(r)
        if not n:
            break
        g_r = gpu_all if n == n_layers else gpu_all[r]
        rank = np.argsort(-g_r, axis=1, kind="stable")  # tied GPU loads in GPU order on every CPU (numpy's
        # default argsort orders ties by its per-CPU SIMD kernel)
        left = caps[r] - step  # [n] swaps left, this one included
        if out_of_reach is not None and (left < n_gpus).any():
            floor_gpu = np.take_along_axis(g_r, rank[np.arange(n), np.minimum(left, n_gpus - 1)][:, None], 1)[:, 0]
            on = (left >= n_gpus) | (floor_gpu <= out_of_reach[r])  # [n] still within reach
            if not on.all():
                r, rank, n = r[on], rank[on], int(on.sum())
                if not n:
                    break
        # a's GPUs: the hottest; b's: the coldest GPUs anywhere and every GPU of the hottest GPU's node (swaps
        # inside a node are always allowed); all P slots made each step [n, S, P] and a [58, 256] plan on 8
        # nodes take 1 s
        near = (rank[:, :1] // gpn) * gpn + in_node  # [n, gpn]
        if one_hot:  # [n, gpn - 1] in the same order, the hot GPU left out
            near = near[near != rank[:, :1]].reshape(n, n_near)
        gpus = np.concatenate([rank[:, :hot_gpus], rank[:, -cold_gpus:], near], 1)  # [n, (S + B) / spg]
        # per-slot values are gathered once for a's and b's slots together ([n, S + B]), straight from the [L, P]
        # arrays, and meet in [n, S, B] only by broadcasting, in the smallest dtypes: at [58, 320] a step is ~20
        # passes over 87K pairs
        ab, ns = (gpus[:, :, None] * spg + in_gpu).reshape(n, -1), hot_gpus * spg
        flat_ab = ab + (r * p)[:, None]  # [n, S + B] into the [L, P] arrays, raveled
        u_ab = np.take(u, flat_ab)
        g = np.take(gpu_all, gpus + (r * n_gpus)[:, None])  # [n, (S + B) / spg] GPU loads
        # a pair on one GPU needs no mask: there ga = gb, so its gain is -d d <= 0 and never passes the floor (>= 0;
        # with a spread > 0, above the product's rounding)
        ab_r, flat_r = ab[:, : ns + ruled], flat_ab[:, : ns + ruled]  # a's slots and b's ruled ones
        node_ab = np.take(slot_node16, ab_r)
        ok = node_ab[:, :ns, None] == node_ab[:, None, ns:]  # [n, S, B'] inside one node: allowed
        if cross_nodes:  # across nodes as the module doc says
            bit_ab = np.take(slot_bit, ab_r)
            bit_a, bit_b = bit_ab[:, :ns, None], bit_ab[:, None, ns:]
            held = np.take(nodes_of, np.take(out, flat_r) + (r * e)[:, None])  # [n, S + B'] node bitmask of each expert
            kin = np.take(grp_a, flat_r[:, :ns])[:, :, None] == np.take(grp_b, flat_r[:, ns:])[:, None, :]
            f_ab = np.take(flag, flat_r)
            kin |= (f_ab[:, :ns, None] & f_ab[:, None, ns:]) != 0  # both cold or both not lone
            # ... and neither expert already on the other's node (the swap would merge its replicas)
            kin &= ((held[:, :ns, None] & bit_b) | (held[:, None, ns:] & bit_a)) == 0
            ok |= kin
        if spread is None and one_hot:  # the hot GPU's best swap, near GPUs only where they can win (_one_hot_best)
            best, top = _one_hot_best(u_ab, g, ok, ns, cold_gpus, spg, buf_d[:n], buf_gain[:n])
        else:
            gain = buf_gain[:n]
            if spread is None:
                # [n, hot GPUs, B] ga - gb: one value per (a's GPU, b's slot), broadcast over a's slots below; made
                # at the [n, S, B] size it was two passes more there
                x = g[:, :hot_gpus, None] - np.repeat(g[:, hot_gpus:], spg, axis=1)[:, None, :]
                # the drop of ga^2 + gb^2 when d moves from a's GPU to b's is 2 (d (ga - gb) - d d); `gain` holds half
                # of it (doubling is exact in binary floating point, so the comparisons below are those of the full
                # drop). The [n, S, B] float arrays live in buffers made once: fresh ones were page-faulted in on
                # every step
                d = buf_d[:n]
                # [n, S, B] load moved from a's GPU to b's; a's side copied in first (one broadcast operand per op:
                # 25% faster)
                _half_drops(d.reshape(n, hot_gpus, spg, -1), gain.reshape(n, hot_gpus, spg, -1),
                            u_ab[:, :ns].reshape(n, hot_gpus, spg, 1), u_ab[:, None, None, ns:], x[:, :, None, :])
            else:  # the same half drop summed over the forecast and the deviations r: (ua - ub) (ga - gb) -
                # (ua - ub)^2 is ua (ga - ua) + ub (gb - ub) + ua (2 ub - gb) - ga ub, one [n, S, 2R + 2] x
                # [n, 2R + 2, B] product, its factors filled in buffers made once (per deviation as [n, S, B] arrays:
                # 0.84 ms a step at [58, 320] with R = 3 against 0.2 here). Rounding: |error| ~1e-16 x the squared mean
                # GPU load, under any floor > 0
                ud = np.take(u_dev, flat_ab, axis=0)  # [n, S + B, R]
                gd = np.repeat(np.take(g_dev, gpus + (r * n_gpus)[:, None], axis=0), spg, axis=1)  # each slot's GPU's
                ua, ga = ud[:, :ns], gd[:, :ns]
                ub, gb = ud[:, ns:].transpose(0, 2, 1), gd[:, ns:].transpose(0, 2, 1)  # [n, R, B]
                fac_a, fac_b = buf_a[:n], buf_b[:n]
                fac_a[:, :, :n_dev] = ua
                np.negative(ga, out=fac_a[:, :, n_dev:-2])
                fac_a[:, :, -2] = np.einsum("nsr,nsr->ns", ua, ga - ua)
                np.subtract(2 * ub, gb, out=fac_b[:, :n_dev])
                fac_b[:, n_dev:-2] = ub
                fac_b[:, -1] = np.einsum("nrb,nrb->nb", ub, gb - ub)
                np.matmul(fac_a, fac_b, out=gain)
            gain[:, :, :ruled] *= ok
            flat = gain.reshape(n, -1)
            best = np.argmax(flat, axis=1)
            top = flat[np.arange(n), best]
        keep = 2 * top > floor[r]
        if not keep.any():
            break
        i, j = np.divmod(best[keep], ab.shape[1] - ns)
        r = r[keep]
        a, b = ab[keep, i], ab[keep, ns + j]
        # the swap's state updates through raveled views, a's and b's slots in one index ([2 n'], a's then b's): one
        # swap per layer, of two different experts on two GPUs (a positive gain needs d != 0 and ga != gb), so no
        # index repeats in a statement
        ab2, ba2, r2 = np.concatenate([a, b]), np.concatenate([b, a]), np.concatenate([r, r])
        both, swapped = r2 * p + ab2, r2 * p + ba2
        rows2 = r2 * e + out_flat[both]  # [2 n'] (layer, expert) rows of cnt and nodes_of: a's expert, then b's
        cnt_rows[rows2, slot_node[ab2]] -= 1
        cnt_rows[rows2, slot_node[ba2]] += 1
        nodes_of_flat[rows2] = ((cnt_rows[rows2] > 0) * bit).sum(1, dtype=mask_t)
        out_flat[both] = out_flat[swapped]
        u_flat[both] = u_flat[swapped]
        flag_flat[both] = flag_flat[swapped]
        code = _home_group(out_flat[both], slot_bit[ab2], group_nodes, gsize, r2)
        grp_a_flat[both] = code
        grp_b_flat[both] = np.where(code < 0, np.int16(-2), code)
        gpu2 = r2 * n_gpus + ab2 // spg
        gpu_all_flat[gpu2] = u_gpus[gpu2].sum(-1)
        if spread is not None:
            u_dev[both] = u_dev[swapped]
            g_dev[gpu2] = u_dev.reshape(-1, spg, n_dev)[gpu2].sum(1)
    return out


def noise_gain(min_gain: float, weight: np.ndarray, cluster: Cluster, count: float) -> float:
    """The leveling's stopping gain for forecast loads weight [L, E] in selections a window: min_gain where a GPU serves
    at most `count` selections a layer and window (PlannerConfig.level_gain_count: the windows it was tuned on), else
    min_gain x count / m for m selections a GPU. A GPU load's sampling noise, as a share of the squared mean load, is
    ~1 / m, and a swap whose gain is below that noise's share is noise in the next window; where m is larger, smaller
    gains are real. Loads not in selections (rates summing to 1) give m << count: min_gain."""
    m = float(weight.sum()) / max(weight.shape[0] * cluster.num_gpus, 1)
    return min_gain * min(1.0, count / m) if m > 0 else min_gain


def _home_group(expert: np.ndarray, node_bit: np.ndarray, group_nodes: np.ndarray, gsize: int,
                layer: np.ndarray) -> np.ndarray:
    """Group of each expert where its group held that node (node_bit) in the input, else -1 (int16); arrays
    broadcast against layer's shape."""
    grp = expert // gsize
    home = (group_nodes[layer, grp] & node_bit) != 0
    return np.where(home, grp, -1).astype(np.int16)


# margin over (ga - gb)^2 / 4 of a swap's rounded gain d (x - d) - d d: with 0 < d / x < 1 each of the three roundings
# errs by < 2^-53 x^2, so the rounded gain stays under x^2 / 4 (1 + 1e-15)
BOUND_MARGIN = 1 + 1e-12


def _half_drops(d: np.ndarray, gain: np.ndarray, ua: np.ndarray, ub: np.ndarray, x: np.ndarray) -> None:
    """gain = (ua - ub) x - (ua - ub)^2 into the buffers d and gain (broadcast shapes), rounded in this one order:
    level_refine's full product and _one_hot_best's two passes share it, so their drops are the same bits."""
    np.copyto(d, ua)
    d -= ub
    np.multiply(d, x, out=gain)
    d *= d
    gain -= d


def _one_hot_best(u_ab: np.ndarray, g: np.ndarray, ok: np.ndarray, ns: int, cold_gpus: int, spg: int,
                  buf_d: np.ndarray, buf_gain: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """level_refine's step with one hot GPU: u_ab [n, S + B] slot loads (the hot GPU's S slots, then the cold GPUs'
    and the near GPUs' slots, spg a GPU), g [n, 1 + B / spg] GPU loads, ok [n, S, cold GPUs' slots] the node rule ->
    (flat index [n] into the [S, B] half drops, its drop [n]): the first largest, as np.argmax over all of them gives.

    A swap with a GPU x = ga - gb lighter drops the half sum of squares by d (x - d) <= x^2 / 4 (d the slot loads'
    difference), so the cold GPUs' columns (the largest x: the coldest GPUs) are scored first and a near GPU's only
    where x^2 / 4 (BOUND_MARGIN) reaches their best: 16 GPUs / 2 nodes / 288 slots, 7 near GPUs a step, most never
    scored. The same roundings in the same order as the full [n, S, B] product, so the same values and index."""
    n, b_all = u_ab.shape[0], u_ab.shape[1] - ns
    ruled = cold_gpus * spg
    x = g[:, :1] - g[:, 1:]  # [n, B / spg] ga - gb, as the full product rounds it
    d, gain = buf_d, buf_gain  # [n, S, ruled]
    _half_drops(d, gain, u_ab[:, :ns, None], u_ab[:, None, ns:ns + ruled],
                np.repeat(x[:, :cold_gpus], spg, axis=1)[:, None, :])
    gain *= ok
    flat = gain.reshape(n, -1)
    j = np.argmax(flat, axis=1)
    top = flat[np.arange(n), j]
    best = (j // ruled) * b_all + j % ruled  # [n] into [S, B]
    near = x[:, cold_gpus:]  # [n, near GPUs]
    li, bi = np.nonzero(near * near * (0.25 * BOUND_MARGIN) >= top[:, None])  # [K] (layer, near GPU) that can win
    if not len(li):
        return best, top
    col = ns + ruled + (bi * spg)[:, None] + np.arange(spg)  # [K, spg] the near GPU's slots in u_ab
    dk, gk = (np.empty((len(li), ns, spg)) for _ in range(2))  # [K, S, spg]
    _half_drops(dk, gk, u_ab[li, :ns][:, :, None], u_ab[li[:, None], col][:, None, :], near[li, bi][:, None, None])
    flat_k = gk.reshape(len(li), -1)
    jk = np.argmax(flat_k, axis=1)
    top_k = flat_k[np.arange(len(li)), jk]
    best_k = (jk // spg) * b_all + ruled + bi * spg + jk % spg
    # per layer the largest drop, the first index among equals: blocks by layer, then drop descending, then index
    order = np.lexsort((best_k, -top_k, li))
    lead = order[np.r_[True, li[order][1:] != li[order][:-1]]]
    rows, v, f = li[lead], top_k[lead], best_k[lead]
    take = (v > top[rows]) | ((v == top[rows]) & (f < best[rows]))
    best[rows[take]], top[rows[take]] = f[take], v[take]
    return best, top
