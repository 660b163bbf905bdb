"""The churn budget of a seeded re-plan (replan.seeded_plan): which layers take their fresh replica counts within
seeded_churn_budget, and how the swaps left of it split over layers.

Shape legend: L layers, E experts, G GPUs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from r3trace.eplb.homing import capped_counts
from r3trace.eplb.score import phy2log_gpu_load

if TYPE_CHECKING:
    from r3trace.eplb.config import PlannerConfig
    from r3trace.eplb.placement import Cluster, Placement


def seeded_counts(w: np.ndarray, prev: Placement, cluster: Cluster, cfg: PlannerConfig, cap: int,
                  capped: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Forecast w [L, E] -> (replica counts [L, E] a seeded re-plan reseats, swaps [L] each layer may take after): the
    fresh counts (capped at `cap`), or, where they would move more than seeded_churn_budget, the fresh counts in layers
    ordered by the largest drop in forecast max load per replica while they fit, the previous ones elsewhere. The
    swaps are what is left of the budget, 2 slots each, split evenly over layers, the remainder one more each to the
    layers whose previous placement's hottest GPU sits highest over the mean under w (swap_shares).
    capped: the fresh counts (homing.capped_counts) where the caller has them."""
    n_layers = w.shape[0]
    logcnt = capped_counts(w, cluster.num_slots, cap) if capped is None else capped
    moved = np.abs(logcnt - prev.logcnt).sum(1) // 2  # [L] slots reseating changes in each layer
    budget = int(cfg.seeded_churn_budget * prev.phy2log.size)
    if moved.sum() > budget:
        gain = (w / prev.logcnt).max(1) / (w / logcnt).max(1)
        take = np.zeros(n_layers, dtype=bool)
        for layer in np.argsort(-gain, kind="stable"):
            if moved[take].sum() + moved[layer] <= budget:
                take[layer] = True
        logcnt = np.where(take[:, None], logcnt, prev.logcnt)
        moved = np.where(take, moved, 0)
    return logcnt, swap_shares(int(budget - moved.sum()) // 2, phy2log_gpu_load(prev.phy2log, w, cluster))


def swap_shares(total: int, gpu_load: np.ndarray) -> np.ndarray:
    """total swaps, the previous placement's GPU loads [L, G] under the forecast -> swaps [L]: total // L each, and
    one more to each of the total % L layers whose hottest GPU sits highest over their mean (ties: the first layers).
    An even split alone (total // L) left up to L - 1 swaps unspent a re-plan: on the sample model's 4 layers of 48
    slots, 7 of the 18 slots a 9.5% budget allows, and held out the leftover swaps lifted its router's serving
    stream (bench/eplb_churn_curve.py's cells) by +0.007 on average, still and slowly drifting mixes alike."""
    n_layers = len(gpu_load)
    out = np.full(n_layers, max(total, 0) // max(n_layers, 1), dtype=np.int64)
    extra = max(total, 0) - int(out.sum())
    if extra:
        mean = gpu_load.mean(1)
        need = np.divide(gpu_load.max(1), mean, out=np.zeros(n_layers), where=mean > 0)
        out[np.argsort(-need, kind="stable")[:extra]] += 1
    return out

