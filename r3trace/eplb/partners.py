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

Shape legend: W windows, L layers, E experts, B floor-bound layers.
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
    rates = h / np.maximum(h.sum(-1, keepdims=True), 1e-12)  # [W, L, E]
    err = partner_errors(rates[:, bound], n)
    alpha = ALPHAS[int(err.argmin())]
    light = bound[:, None] & ~hot
    out = w.copy()
    out[light] = forecast(h, alpha)[light]
    return out
