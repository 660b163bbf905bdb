"""The light partners of the hottest GPUs: where every slot holds one expert and the hottest experts alone set the max
GPU load, the light experts' forecast comes from the EMA weight that, in backtest, picked the lightest ones best.

Why: in such a layer (every slot one expert, > 2 slots a GPU, the hottest expert alone over (1 + refresh_floor) x
the mean GPU load: the m = 1 term of replan.max_load_floor) each hot expert's GPU carries it and S - 1 of the
lightest experts, so what the max GPU load is next window depends on which experts are truly light then. The
forecast's EMA weight (forecast.py) is picked by its squared error over all experts, which the hot ones dominate: on
grouped s = 1.2, 16 GPUs / 2 nodes / 256 slots, trace seed 1, windows 0 -> 2 moved enough that it picked the newest
window alone, and the 15 lightest by that forecast weighed 0.0800 mean GPU loads in the next window, by the 8-window
mean 0.0764 (truly lightest: 0.0552). Here each weight instead forecasts every backtest window t >= 2 from the
windows before it, picks the n lightest experts of each floor-bound layer (n = (S - 1) x the experts above the mean
GPU load), and is scored by what those weigh in window t; the least total wins, and the layer's experts at or below
the mean GPU load take that weight's forecast (the hot ones keep theirs).

Over bench/eplb_matrix.py's 12 cells it changes (256 slots on 2, 4 and 8 nodes, grouped router, s = 0.3-1.2), trace
seeds 0-2 pooled: mean +0.00023; the three "no"s at s = 1.2 became ties (+0.00053, +0.00015, +0.00005), s = 0.9 on
64 / 8 / 256 tie -> yes, one cell down (s = 0.6 on 64 / 8 / 256, -0.0001, a tie either way), churn up 0.2 points and
nodes per token up 0.01 at most (still under global's). With two slots a GPU (16 nodes) pairing.py sets each hot
GPU's one partner; there the same rule moved clustered s = 0.6 128 / 16 / 256 by -0.0001 (tie -> no), so those
layers keep the forecast.

With two slots a GPU and every slot one expert (128 GPUs / 16 nodes / 256 slots) a hot GPU holds its expert and one
partner, and the next window's max GPU load is the hottest expert's (which one it is changes between windows) plus
that partner's: coldest_partners gives the hot_partners hottest experts the coldest ones, hottest with coldest, as
DeepSeek's packing pairs them (heaviest item with the lightest open pack). Ours' partners had been the coldest of
what its node and churn rules left: 2nd-5th coldest by the summed history on the SGLang-dump s = 0.6 slow cell, whose
held-out max GPUs then carried partners of 41-59 routed tokens against global's 18-38. Trace seed 0, held out, against
the better global policy: SGLang-dump s = 0.6 slow -0.00020 +- 0.00008 -> +0.00001 +- 0.00001, clustered s = 0.6
fast -0.0014 +- 0.0006 -> -0.0007 +- 0.0006, independent s = 0.6 fast -0.00017 +- 0.00007 -> -0.00004 +- 0.00004 at
+0.2 / +0.8 / +1.0 points of churn a re-plan and nodes per token the same or lower (5.675 -> 5.673, 5.736 -> 5.733,
5.722 -> 5.700). One hot expert: no change on the SGLang cell (the forecast's hottest already had the coldest; the
held-out max GPU was another's); the summed history or the newest window in place of the forecast: worse on the fast
cells, and so was the history's mean unless the backtest calls drift; 32 hot experts (every partner anti-sorted):
the same ties at +8-11 points of churn. The cold ones are ranked by cold_forecast: the EMA weight whose backtest
picked each such layer's 16 lightest experts best (partner_errors). The all-expert weight follows the hot experts:
on the one-group independent router at s = 1.2, slow drift, the backtest calls drift and the forecast is mostly the
newest window (partners 2nd-56th coldest by 8 windows; pooled over trace seeds 0-2 the matrix's last "no", -0.00001
against global, -> +0.000007). Over the 22 cells of 128 / 16 / 256, seeds 0-2 pooled: 8 / 13 / 1 -> 14 / 8 / 0, 17
cells up, 2 down; seed 0 alone 13 / 9 / 0 -> 12 / 8 / 2 (two fast-drift cells, -0.0003 .. -0.0004). Scored on each
layer's 3 lightest instead (the partners it takes): the backtest was too noisy (fast cells -0.0002 .. -0.0006).

Shape legend: W windows, L layers, E experts, B floor-bound layers, P slots.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.forecast import ALPHAS, forecast, smooth_rates
from r3trace.eplb.placement import Cluster


def applies(cluster: Cluster, num_experts: int) -> bool:
    """True where the hot GPUs' partners are the lightest experts: every slot one expert, > 2 slots a GPU."""
    return cluster.num_slots == num_experts and cluster.slots_per_gpu > 2


def partner_errors(rates: np.ndarray, n: np.ndarray) -> np.ndarray:
    """rates [W, B, E] (each window's loads over its total), partners n [B] -> [len(ALPHAS)]: per EMA weight, the
    summed rate in window t of each layer's n lightest experts by that weight's forecast from windows 0 .. t - 1,
    over t = 2 .. W - 1."""
    out = np.zeros(len(ALPHAS))
    for i, a in enumerate(ALPHAS):
        for t in range(2, len(rates)):
            order = np.argsort(smooth_rates(rates[:t], a), axis=1, kind="stable")  # [B, E] lightest first
            take = np.zeros(order.shape, dtype=bool)
            np.put_along_axis(take, order, np.arange(order.shape[1])[None, :] < n[:, None], axis=1)
            out[i] += float(rates[t][take].sum())
    return out


def partner_forecast(history: np.ndarray, w: np.ndarray, cluster: Cluster, margin: float) -> np.ndarray:
    """history [W, L, E] loads, the plan's forecast w [L, E] -> w with the light experts of the floor-bound layers (the
    hottest expert alone above (1 + margin) x the mean GPU load; replan.floor_bound also counts the pigeonhole
    terms of the layer's other replicas) forecast by the EMA weight whose partners weighed least in backtest
    (module doc); w itself where the cluster has spare slots or <= 2 slots a GPU, with < 3 windows, or without
    such a layer."""
    h = np.asarray(history, dtype=np.float64)
    if h.ndim != 3 or len(h) < 3 or not applies(cluster, w.shape[1]):
        return w
    mean = w.sum(1) / cluster.num_gpus  # [L] mean GPU load
    bound = w.max(1) > (1 + margin) * mean  # [L] one replica an expert: the floor is the hottest expert
    if not bound.any():
        return w
    hot = w > mean[:, None]  # [L, E] each alone on its GPU in any layout near the floor
    n = np.minimum(hot.sum(1) * (cluster.slots_per_gpu - 1), w.shape[1] - hot.sum(1))[bound]  # [B]
    light = bound[:, None] & ~hot
    out = w.copy()
    out[light] = forecast(h, _backtest_weight(h, bound, n))[light]
    return out


def _backtest_weight(h: np.ndarray, rows: np.ndarray, n: np.ndarray) -> float:
    """history [W, L, E], layers rows [L] bool, lightest experts n [B] per such layer -> the EMA weight of ALPHAS whose
    n lightest weighed least in the next window in backtest (partner_errors)."""
    rates = h / np.maximum(h.sum(-1, keepdims=True), 1e-12)  # [W, L, E]
    return ALPHAS[int(partner_errors(rates[:, rows], n).argmin())]


def cold_forecast(history: np.ndarray, w: np.ndarray, cluster: Cluster, light: int) -> np.ndarray:
    """history [W, L, E] loads, the plan's forecast w [L, E] -> [L, E] the forecast by the EMA weight whose `light`
    lightest experts, in the layers with an expert above the mean GPU load, weighed least in the next window in
    backtest (partner_errors): what coldest_partners ranks the cold experts by (module doc). w itself with < 3
    windows, light <= 0, or no such layer."""
    h = np.asarray(history, dtype=np.float64)
    if h.ndim != 3 or len(h) < 3 or light <= 0:
        return w
    mean = w.sum(1) / cluster.num_gpus
    rows = (w > mean[:, None]).any(1)
    if not rows.any():
        return w
    return forecast(h, _backtest_weight(h, rows, np.full(int(rows.sum()), light)))


def coldest_partners(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, hot: int,
                     cold_w: np.ndarray | None = None) -> np.ndarray:
    """phy2log [L, P] with P = E and two slots a GPU, forecast w [L, E] -> phy2log [L, P] where each of the layer's
    `hot` hottest experts that weighs more than the mean GPU load shares its GPU with one of as many coldest other
    experts, the hottest with the coldest (module doc): one swap of two slots where its partner is another; phy2log
    itself on other shapes or with hot <= 0."""
    n_layers, p = phy2log.shape
    if hot <= 0 or cluster.slots_per_gpu != 2 or p != w.shape[1]:
        return phy2log
    out = phy2log.copy()
    mean = w.sum(1) / cluster.num_gpus  # [L]
    hottest = np.argsort(-w, axis=1, kind="stable")[:, :hot]  # [L, hot]
    coldest = np.argsort(w if cold_w is None else cold_w, axis=1, kind="stable")  # [L, E] ties by expert id
    for layer in range(n_layers):
        hots = [x for x in hottest[layer].tolist() if w[layer, x] > mean[layer]]
        if not hots:
            continue
        row = out[layer]
        slot_of = np.empty(p, dtype=np.int64)
        slot_of[row] = np.arange(p)
        cold = [x for x in coldest[layer, : 2 * hot].tolist() if x not in hots][: len(hots)]
        for x, c in zip(hots, cold, strict=False):
            q = int(slot_of[x]) ^ 1  # the other slot of x's GPU (GPU g holds slots 2g, 2g + 1)
            y = int(row[q])
            if y != c:
                qc = int(slot_of[c])
                row[q], row[qc] = c, y
                slot_of[c], slot_of[y] = q, qc
    return out
