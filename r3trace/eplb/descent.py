"""Hot swaps: a seeded re-plan's last moves, on its hottest GPUs' loads, with what its churn budget left.

Why: the next window's hottest GPU is often not the forecast's. Held out on bench/eplb_matrix.py's 32 GPUs / 4
nodes / 256 slots at s = 0.9 the held-out max sat on the forecast's third GPU, whose cold companions weighed 247
against global's 161: DeepSeek's global policy packs greedily, so every hot expert's GPU gets the coldest experts,
while a seeded re-plan (replan.seeded_plan) keeps the previous layout and its leveling swaps work on the one or two
hottest GPUs (and stop early: without a spare slot re-plans moved 1-2% of slots of a 9.5% budget).

Each step lowers the hottest of the hot_gpus hottest GPUs h that has a swap leaving both GPUs below h's load by more
than min_drop x the mean GPU load (a transfer from h to a cooler GPU: the sorted GPU loads only fall, so every sum
of the k hottest is no higher); of those swaps, the one with the lowest max of the two. A slot stays in its node
unless both replicas are their expert's only one and below cold x the mean slot load (leveling.py's rule for cold
replicas: rarely chosen, so their node matters little). Over bench/eplb_matrix.py's 118 cells, yes / tie / no
against the better global policy: 42 / 62 / 14 -> 48 / 59 / 11 at hot_gpus 8, min_drop 0.01 (35 cells up, 18 down by
more than 0.0003, mean +0.0004); the hottest GPU alone, inside nodes, min_drop 0.002: noise (on the 90 slow-drift
and shape cells 21 up, 20 down, one to no); min_drop 0.005: 51 / 56 / 11 with a new no (16 GPUs / 2 nodes / 320
slots, s = 0.9); 16 GPUs: a new no (144 / 18 / 288, s = 0.9); inside nodes only: 49 / 56 / 13. The same swaps after
fresh plans (fresh_swaps a layer): 48 / 58 / 12 with two new no's, so fresh plans keep their leveling and polish
alone. A drifting re-plan's seeded layers (replan.refreshed) skip them: most take the fresh plan anyway, and with
them the totals were the same while the drifting re-plan without a spare slot took 0.282x of DeepSeek's default
call instead of 0.232x (--plan-time, 64 GPUs / 8 nodes / 256 slots).

Floor-bound layers (PlannerConfig.floor_hot_drop): where the hottest replicas alone set the max load
(replan.floor_bound at refresh_floor) a seeded re-plan's swaps take drops > 0.002 x the mean GPU load (min_gain's
noise floor) instead of min_drop. Held out on 32 GPUs / 4 nodes / 256 slots (grouped router, s = 0.9) the max sat on
the hottest expert's GPU in every layer and window, its other slots 0.12-0.26 of the mean GPU load against global's
0.12-0.22 (global packs the coldest experts beside the hottest), and a swap there lowers it by < 1%. Over
bench/eplb_matrix.py's 118 cells yes / tie / no 70 / 41 / 7 -> 70 / 42 / 6: that cell -0.0010 -> -0.0004 (no -> tie),
s = 1.2 tie -> yes, 64 / 8 / 256 at s = 0.9 yes -> tie (+0.0001 -> -0.0001 +- 0.0002). Only with > 2 slots a GPU
(with two, pairing.py picks the hottest replica's companion): there it re-planned identical loads moving 1.1% of
slots (tests/analysis/test_eplb_seeded.py holds that to 1%).

Before the P = E contest (PlannerConfig.contest_swaps, planner.fresh_plan): up to 32 swaps on ours' hottest GPU, any
drop. The leveling lowers squared loads and left ours' max load 0.5-2% over global's, so global won every layer on
the max load though ours' group homes had fewer nodes per token (held out 1.984 against 1.996 at s = 1.2 on 16 / 2 /
256, 3.20 against 3.58 at s = 0.9 on 32 / 4); after them ours ties or beats global's max load in 95-100% of the
layers at [58, 256] on 2-8 nodes. With the floor-bound swaps the matrix went to 70 / 43 / 5 (16 / 2 / 256 at s = 1.2
no -> tie: 1.99 nodes per token against 2.00); P = E nodes per token -0.3 .. -1.1 on 4-8 nodes. Without the
floor-bound swaps, on the 8 hottest GPUs (64 swaps) instead of the hottest alone: 16 / 2 and 32 / 4 no -> tie,
64 / 8 / 256 at s = 0.6 and 128 / 16 / 256 at s = 0.9 tie -> yes, but its swaps made a fresh plan on 64 / 8 / 256
take 0.10 s instead of 0.05 (0.2x the reference's call is 0.05 s there); on the hottest GPU alone 0.002 s.

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
