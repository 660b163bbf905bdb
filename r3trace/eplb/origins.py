"""Where each layer of ours' plan came from, read off the plan: its own layout, DeepSeek global's on the same
forecast (the per-layer contests of candidates.py and dispatch_contest.py hand a layer global's GPUs; with keep_groups,
DeepSeek hierarchical's, dispatch_contest.groups_contest), or the previous placement's layer unchanged (a re-plan that
kept it: the budget left it alone, or replay_guard kept it).
`r3trace eplb` prints the counts beside the layout line, so the line says what the planner did, not only what it may do.

A layer is compared by what its GPUs hold, each GPU's experts as a set and the GPUs as a multiset: the contests
may take global's GPUs in another order (candidates.by_group, regroup.py) and a re-plan aligns a layer to the
previous one (alignment.py), neither of which changes any GPU's load.
Shape legend: L layers, E experts, P slots, G GPUs.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.deepseek import global_phy2log, hierarchical
from r3trace.eplb.dispatch_contest import groups_apply
from r3trace.eplb.drift_call import DriftCall
from r3trace.eplb.placement import Cluster, Placement
from r3trace.eplb.plan_forecast import planning_forecast

Origin = Literal["previous", "global", "hierarchical", "ours"]


def gpu_contents(phy2log: np.ndarray, cluster: Cluster) -> list[tuple[tuple[int, ...], ...]]:
    """phy2log [L, P] -> per layer the sorted tuple of its GPUs' sorted expert tuples (GPU and slot order dropped)."""
    gpus = np.sort(phy2log.reshape(phy2log.shape[0], cluster.num_gpus, cluster.slots_per_gpu), axis=2)
    return [tuple(sorted(tuple(int(x) for x in g) for g in layer)) for layer in gpus]


def layer_origins(pl: Placement, loads: np.ndarray, cluster: Cluster, prev: Placement | None = None,
                  cfg: PlannerConfig = PlannerConfig(), mixed: np.ndarray | None = None,
                  tokens: np.ndarray | None = None, demixed: np.ndarray | None = None,
                  call: DriftCall | None = None) -> list[Origin]:
    """Ours' plan pl of loads [W, L, E] (or [L, E]) re-planned from prev -> [L] each layer's origin: "previous"
    where its GPUs hold what prev's did, else "global" ("hierarchical" with cfg.keep_groups, where that layout
    exists) where they hold what DeepSeek's plan on the same forecast (plan_forecast.planning_forecast) does, else
    "ours". call: the plan's drift call (drift_call.py), where the caller made it."""
    w, _ = planning_forecast(loads, prev, cfg, cluster, mixed, tokens, demixed, call)
    mine = gpu_contents(pl.phy2log, cluster)
    groups = cfg.keep_groups and groups_apply(cluster, cfg.replay_margin)
    name: Origin = "hierarchical" if groups else "global"
    theirs = gpu_contents(hierarchical(w, cluster).phy2log if groups else global_phy2log(w, cluster), cluster)
    old = gpu_contents(prev.phy2log, cluster) if prev is not None else [None] * len(mine)
    return ["previous" if m == o else name if m == t else "ours" for m, t, o in zip(mine, theirs, old, strict=True)]


def origins_line(origins: list[Origin], previous: bool, theirs: Origin = "global") -> str:
    """'layers: 52 ours, 4 DeepSeek global's, 2 unchanged from --previous' (the last only for a re-plan); theirs:
    the DeepSeek policy the plan's layers were contested against (hierarchical for keep_groups)."""
    n = {k: origins.count(k) for k in ("ours", theirs, "previous")}
    text = f"layers: {n['ours']} ours, {n[theirs]} DeepSeek {theirs}'s on the same forecast"
    return text + (f", {n['previous']} unchanged from --previous" if previous else "")
