"""Hot swaps: a seeded re-plan's last moves, on its hottest GPUs' loads, with what its churn budget left.

Why: the next window's hottest GPU is often not the forecast's (32 GPUs / 4 nodes / 256 slots, s = 0.9: the held-out
max sat on the forecast's third GPU, whose cold companions weighed 247 against global's 161). DeepSeek's global
policy packs greedily, so every hot expert's GPU gets the coldest experts; a seeded re-plan (replan.seeded_plan)
keeps the previous layout, and its leveling works on the one or two hottest GPUs and stops early.

What: each step lowers the hottest of the hot_gpus hottest GPUs h that has a swap leaving both GPUs below h's load by
more than min_drop x the mean GPU load (a transfer from h to a cooler GPU: the sorted GPU loads only fall); of those
swaps, the one with the lowest max of the two. A slot stays in its node unless both replicas are their expert's only
one and below cold x the mean slot load (leveling.py's rule for cold replicas). The settings, over
bench/eplb_matrix.py's cells: hot_gpus 8 and min_drop 0.01 (35 cells up, 18 down by more than 0.0003, mean +0.0004;
min_drop 0.005 and swaps inside nodes only each made new "no"s). Fresh plans and a drifting re-plan's seeded layers
skip them (after fresh plans they made two new "no"s; a drifting re-plan kept its verdicts without them, at 0.23x of
DeepSeek's default call against 0.28x with them).

Floor-bound layers (PlannerConfig.floor_hot_drop): where the hottest replicas alone set the max load
(replan.floor_bound), a swap lowers it by < 1%, so their swaps take any drop (floor_hot_drop 0): the rest of a hot GPU
is its light partners, and a lighter one lowers the GPU's expected load in the next window by the whole difference
(the forecast of a light expert is the mean of several windows; which of the hottest few GPUs is the max held out is
a draw). Over bench/eplb_matrix.py's 118 cells, against drops > 0.002 x the mean GPU load (min_gain's noise floor): the
9 cells it changed (P = E, > 2 slots a GPU) +0.0002 on average, 64 / 8 / 256 at s = 0.9 no -> tie (-0.00017 +-
0.00006 -> -0.00005 +- 0.00004), no new "no", their churn up to 1.7 points more (at most 9.4% a re-plan). Only with
> 2 slots a GPU (with two, pairing.py picks the hottest replica's companion).

Before the P = E contest (PlannerConfig.contest_swaps, fresh.fresh_plan): up to 32 swaps on ours' hottest GPU, any
drop: the leveling lowers squared loads and leaves ours' max load 0.5-2% over global's; after them ours ties or
beats global's max load in 95-100% of the layers at [58, 256] on 2-8 nodes, at 0.3-1.1 fewer nodes per token. They
cost 0.002 s a plan on the hottest GPU alone; on the 8 hottest they doubled a fresh plan on 64 / 8 / 256 to 0.10 s
(the goal there: 0.05 s).
The measurements behind each choice: docs/perf-history/benchmarks-log.md, "descent.py's tuning record".

Shape legend: L layers, E experts, P slots, G GPUs, S slots per GPU, B layers still looking for a move.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster


def hot_swaps(phy2log: np.ndarray, weight: np.ndarray, logcnt: np.ndarray, cluster: Cluster, swaps: np.ndarray,
              min_drop: float | np.ndarray, cold: float = -1.0, hot_gpus: int = 1) -> np.ndarray:
    """phy2log [L, P], forecast weight [L, E], counts logcnt [L, E], swaps [L] the most swaps (2 slots each) per
    layer, min_drop one for every layer or [L] -> phy2log [L, P]. Each step takes, of the layer's hot_gpus hottest
    GPUs, the hottest h that has a swap of one of its slots with a slot of another GPU leaving both below h's load by
    more than min_drop x the mean GPU load (the sorted GPU loads fall lexicographically: no GPU reaches h's load),
    the pair with the lowest max of the two; a layer stops at its first step without one. A slot may leave its node
    only where both swapped replicas are their expert's only one and below cold x the mean slot load (cold < 0:
    never)."""
    out = np.asarray(phy2log, dtype=np.int64).copy()
    n_layers, p = out.shape
    g, s = cluster.num_gpus, cluster.slots_per_gpu
    m = min(hot_gpus, g)
    if m <= 0:
        return out
    per_rep = weight / logcnt  # [L, E]
    u = np.take_along_axis(per_rep, out, 1)  # [L, P] load of each slot
    gl = u.reshape(n_layers, g, s).sum(2)  # [L, G]
    floor = min_drop * weight.sum(1) / g  # [L]
    left = np.asarray(swaps, dtype=np.int64).copy()
    slot_gpu, slot_node = cluster.slot_gpu(), cluster.slot_node()
    lone = np.take_along_axis(logcnt, out, 1) == 1  # [L, P] counts fixed: moves with the expert
    cold_slot = cold * weight.sum(1) / g / s  # [L] below this a lone replica may change node
    replicas = bool((logcnt > 1).any())  # else no two slots hold one expert
    for _ in range(int(left.max(initial=0))):
        act = np.flatnonzero(left > 0)
        if not len(act):
            break
        hs = np.argsort(-gl[act], axis=1, kind="stable")[:, :m]  # [A, M] hottest GPUs first
        other = gl[act][:, slot_gpu]  # [A, P] load of each slot's GPU
        chill_b = (u[act] < cold_slot[act][:, None]) & lone[act]  # [A, P]
        move = np.full((len(act), 2), -1)  # [A] (slot on h, slot on the other GPU) of each layer's step
        todo = np.arange(len(act))
        for r in range(m):  # the hottest GPU with a move; each rank only for the layers still without one
            la, h = act[todo], hs[todo, r]
            mine = h[:, None] * s + np.arange(s)  # [B, S] h's slots
            a = u[la[:, None], mine]  # [B, S]
            hl = gl[la, h]  # [B]
            d = u[la][:, None, :] - a[:, :, None]  # [B, S, P] load h gains
            new = np.maximum(hl[:, None, None] + d, other[todo][:, None, :] - d)
            # allowed: another GPU's slot inside h's node, or both replicas lone and cold; never the same expert
            near = (slot_node[None, :] == slot_node[mine[:, :1]]) & (slot_gpu[None, :] != h[:, None])  # [B, P]
            chill = ((a < cold_slot[la][:, None]) & lone[la[:, None], mine])[:, :, None] & chill_b[todo][:, None, :]
            ok_pair = near[:, None, :] | chill  # [B, S, P]; a cold pair both on h never lowers h
            if replicas:
                ok_pair &= out[la[:, None], mine][:, :, None] != out[la][:, None, :]
            new = np.where(ok_pair, new, np.inf).reshape(len(la), -1)
            best = new.argmin(1)  # [B]
            ok = new[np.arange(len(la)), best] < hl - floor[la]
            move[todo[ok], 0] = h[ok] * s + best[ok] // p
            move[todo[ok], 1] = best[ok] % p
            todo = todo[~ok]
            if not len(todo):
                break
        left[act[todo]] = 0  # no hot GPU of these layers has a move
        has = move[:, 0] >= 0
        act, i, j = act[has], move[has, 0], move[has, 1]
        out[act, i], out[act, j] = out[act, j], out[act, i].copy()
        u[act, i], u[act, j] = u[act, j], u[act, i].copy()
        lone[act, i], lone[act, j] = lone[act, j], lone[act, i].copy()
        gl[act] = u[act].reshape(len(act), g, s).sum(2)
        left[act] -= 1
    return out
