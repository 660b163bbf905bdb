"""One node under SGLang's static (and dynamic) dispatch: replica counts that divide the GPU count.

Why: on one node SGLang's node rule never applies (static.py rule 3); a rank holding a replica of expert e sends to
it, and the G - c ranks without one are spread over e's c replicas, (G - c) // c each and (G - c) mod c of them one
more, by a seeded draw (rule 4). Where c divides G and the replicas sit on distinct GPUs, every replica serves G / c
ranks: the even split exactly, whatever the draw; elsewhere the worst replica serves ceil(G / c) of G (c = 3 on 8
GPUs: 3 where the even split gives 2.67). Ours' default plan sat 0.006-0.061 of static balancedness under its own
even split on bench/eplb_matrix.py's one-node cells (8 GPUs / 288 slots at s = 1.2: 0.885 against 0.947).

How, per layer: each count rounded down to a divisor of G, the freed slots given back as upgrades to the next
divisor, highest load per replica first (c -> c' costs c' - c slots; slots no upgrade fits go to single extra
replicas, the one case left uneven); the replicas given up leave the hottest GPUs, the new ones take the freed slots
on the lightest GPUs without their expert; then swaps off the hottest GPU that keep every expert's replicas on
distinct GPUs, while they lower it. Only the experts whose count changes move, so a re-plan of a plan made so moves
what its default re-plan moves plus its leveling. Last, a layer keeps the plan's own layout where that has the lower
forecast max GPU load under static dispatch (keep_lower).
Shape legend: L layers, P slots, E experts, G GPUs.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.placement import Cluster
from r3trace.eplb.static import static_expected_load
from r3trace.eplb.static_spread import LEVEL_SHARE  # slots a layer the leveling may move, as a share of P


def divisor_counts(count: np.ndarray, w: np.ndarray, g: int) -> np.ndarray:
    """count [E] replicas (each <= G), loads w [E] -> [E] counts dividing G where the slots allow, summing to the
    same total (module doc)."""
    divs = [d for d in range(1, g + 1) if g % d == 0]
    top = max(g, int(count.max())) + 1
    down = np.array([max((d for d in divs if d <= c), default=0) for c in range(top)])  # the divisor at or below c
    up = np.array([next((d for d in divs if d > c), 0) for c in range(top)])  # the next one above c, 0: none
    t = down[count]
    free = int((count - t).sum())
    while free > 0:
        nxt = up[t]
        cost = nxt - t
        fits = (nxt > 0) & (cost <= free)
        if not fits.any():
            break
        x = int(np.argmax(np.where(fits, w / t, -np.inf)))
        t[x], free = nxt[x], free - int(cost[x])
    while free > 0:  # no upgrade fits: single replicas to the highest loads per replica below G
        x = int(np.argmax(np.where(t < g, w / t, -np.inf)))
        t[x], free = t[x] + 1, free - 1
    return t


def static_one_node(phy2log: np.ndarray, weight: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P], weight [L, E] (the forecast planned on), one node -> phy2log [L, P] with divisor counts
    (module doc); a new array."""
    out = phy2log.copy()
    for layer in range(len(out)):
        _layer(out[layer], weight[layer], cluster)
    return out


def keep_lower(phy2log: np.ndarray, divided: np.ndarray, weight: np.ndarray, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P] (the plan's layout), divided [L, P] (static_one_node's of it), weight [L, E] -> per layer the
    one with the lower forecast max GPU load under static dispatch (static_expected_load), divided where they tie.

    Why: rounding counts to divisors of G gives up replicas where few slots are spare on many GPUs: on 16 GPUs /
    80 slots (64 experts, Zipf 0.6 and 1.2, tests/analysis/test_eplb_static_one_node.py) the divisor layouts held
    out 0.879 / 0.824 under static dispatch against the plan's own 0.942 / 0.869 (DeepSeek global 0.924 / 0.830)."""
    before, after = (static_expected_load(x, weight, cluster).max(1) for x in (phy2log, divided))  # [L]
    return np.where((before < after * (1 - 1e-9))[:, None], phy2log, divided)


def _layer(ph: np.ndarray, w: np.ndarray, cl: Cluster) -> None:
    """One layer ph [P] in place."""
    e, g, spg = len(w), cl.num_gpus, cl.slots_per_gpu
    gpu_of = np.arange(len(ph)) // spg
    count = np.bincount(ph, minlength=e)
    target = divisor_counts(count, w, g)
    if np.array_equal(target, count):
        _spread(ph, w / count, gpu_of, g)
        return
    load = np.bincount(gpu_of, weights=(w / count)[ph], minlength=g)  # [G] even-split load before
    freed: list[int] = []
    for x in np.flatnonzero(count > target):  # give up replicas on the hottest GPUs
        slots = np.flatnonzero(ph == x)
        freed += slots[np.argsort(-load[gpu_of[slots]], kind="stable")][: count[x] - target[x]].tolist()
    share = w / target
    held = np.zeros((e, g), dtype=bool)  # [E, G] GPUs holding each expert, after the release
    keep = np.ones(len(ph), dtype=bool)
    keep[freed] = False
    held[ph[keep], gpu_of[keep]] = True
    load = np.bincount(gpu_of[keep], weights=share[ph[keep]], minlength=g)
    need = np.repeat(np.arange(e), np.maximum(target - count, 0))
    need = need[np.argsort(-share[need], kind="stable")]  # heaviest new replica first
    open_slots = list(freed)
    for x in need:
        gpus = gpu_of[open_slots]
        ok = ~held[x, gpus]
        pick = int(np.argmin(np.where(ok, load[gpus], np.inf))) if ok.any() else int(np.argmin(load[gpus]))
        s = open_slots.pop(pick)
        ph[s] = x
        held[x, gpu_of[s]] = True
        load[gpu_of[s]] += share[x]
    _spread(ph, share, gpu_of, g, max(int(LEVEL_SHARE * len(ph) / 2), 1))


def _spread(ph: np.ndarray, share: np.ndarray, gpu_of: np.ndarray, g: int, steps: int = 0) -> None:
    """ph [P] in place: a second replica of an expert on one GPU swapped to a GPU without one (SGLang's rule 2
    sends the GPU's own rank to the first, so two on one GPU split unevenly), the swap whose two GPUs' higher load
    is lowest; then `steps` leveling swaps (_level)."""
    e = len(share)
    on = np.zeros((e, g), dtype=np.int64)  # [E, G] replicas of each expert on each GPU
    np.add.at(on, (ph, gpu_of), 1)
    load = np.bincount(gpu_of, weights=share[ph], minlength=g)  # [G]
    for x, h in np.argwhere(on > 1):
        while on[x, h] > 1:
            s = int(np.flatnonzero((ph == x) & (gpu_of == h))[-1])
            f, o = ph, gpu_of  # every slot a candidate: the expert it holds, its GPU
            delta = share[f] - share[x]
            worst = np.maximum(load[h] + delta, load[o] - delta)
            legal = (o != h) & (f != x) & (on[x, o] == 0) & (on[f, h] == 0)
            if not legal.any():
                break
            _swap(ph, s, int(np.argmin(np.where(legal, worst, np.inf))), share, load, gpu_of, on)
    _level(ph, share, load, gpu_of, on, steps)


def _swap(ph: np.ndarray, s: int, d: int, share: np.ndarray, load: np.ndarray, gpu_of: np.ndarray,
          on: np.ndarray) -> None:
    """Swap slots s and d in place, the GPU loads and per-GPU replica counts kept."""
    a, b, gs, gd = int(ph[s]), int(ph[d]), int(gpu_of[s]), int(gpu_of[d])
    load[gs] += share[b] - share[a]
    load[gd] += share[a] - share[b]
    on[a, gs] -= 1
    on[a, gd] += 1
    on[b, gd] -= 1
    on[b, gs] += 1
    ph[s], ph[d] = b, a


def _level(ph: np.ndarray, share: np.ndarray, load: np.ndarray, gpu_of: np.ndarray, on: np.ndarray,
           steps: int) -> None:
    """Up to `steps` swaps of a slot of the hottest GPU with a slot elsewhere, the pair whose two GPUs' higher load
    after it is lowest, taken while that is below the hottest's load and neither expert then has two replicas on
    one GPU."""
    for _ in range(steps):
        h = int(np.argmax(load))
        top = load[h]
        mine, others = np.flatnonzero(gpu_of == h), np.flatnonzero(gpu_of != h)
        x, f = ph[mine][:, None], ph[others][None, :]  # [S, 1], [1, O]
        o = gpu_of[others][None, :]
        delta = share[f] - share[x]
        worst = np.maximum(top + delta, load[o] - delta)
        legal = (f != x) & (on[x, o] == 0) & (on[f, h] == 0) & (worst < top * (1 - 1e-9))
        if not legal.any():
            return
        i, j = np.unravel_index(int(np.argmin(np.where(legal, worst, np.inf))), worst.shape)
        _swap(ph, int(mine[i]), int(others[j]), share, load, gpu_of, on)
