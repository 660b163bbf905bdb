"""Our placement planner: one node per expert, planned for the next window, migration-bounded.

1. Forecast: an exponential moving average of the per-window loads [W, L, E] (each window normalised to
   rates), so one noisy window does not move replicas: the global policy plans on the last window alone
   and loses 4-6 points of balancedness on the next one.
2. Replica counts: the global policy's rule (each extra slot to the expert with the highest load per
   replica), capped at the GPUs of one node (homing.capped_counts).
3. One node per expert (homing.expert_nodes): heaviest per-replica load first onto the lightest node with
   room, preferring the expert's home (its group's node, or its node in the previous placement) when that
   costs at most `home_slack` of a node's mean load. When the node limit binds (fewer than N nodes per
   token, groups % N == 0) groups stay whole on their nodes instead (DeepSeek's hierarchical layout).
   A node-limited dispatcher then has a single cover per token, so the load it produces is the
   even-split load the plan balanced.
   When a group cannot sit on one node (groups % N != 0, 144 GPUs on 18 nodes) one node per expert
   reached 6.7-7.1 nodes per token; there groups get home runs of whole nodes and extra replicas go to
   the nodes of the experts they are chosen with in the window's tokens (affinity.py): 4.8-5.8 nodes,
   at the price of node-limited balancedness below the even one (`spread_by_affinity`). There replicas
   sit on distinct nodes anyway, so counts are capped at N, not at one node's GPUs (s = 1.0: 0.535 ->
   0.539 held out on 144 GPUs).
4. Each node's replicas are packed onto its GPUs (balanced packing), then up to `fresh_swaps` swaps
   lower the hottest GPUs (refine.swap_refine; 0.925 -> 0.944 held out on 32 GPUs). In the spread layout
   leveling swaps lower the sum of squared GPU loads instead (leveling.py: 0.835 / 0.744 / 0.535 ->
   0.837 / 0.749 / 0.543 held out at s = 0.3 / 0.6 / 1.0).
5. Migration: with a previous placement, a layer is re-placed only when the fresh plan lowers its forecast
   max GPU load by more than `keep_tolerance`; otherwise the previous layer is kept and gets at most
   `replan_swap_share` of its slots in swaps (2 slots each). Layers are re-placed biggest gain first
   while the moved slots stay within `churn_budget` of all slots. A re-placed layer is aligned to the
   previous one (GPUs matched by shared experts, experts kept in their slots) so only replicas that really
   move are transferred. In the spread layout a re-placed layer moved 154-247 of 288 slots, so there the
   re-plan is seeded instead (seeded_plan): every layer takes its fresh counts by moving only the replicas
   whose count changed (reseat.py: 1-3 slots per layer), then leveling swaps use the rest of
   `seeded_churn_budget`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from r3trace.eplb.affinity import affinity_replicas, coactivation_counts, home_primaries
from r3trace.eplb.deepseek import group_nodes, hierarchical, pack_nodes, spread_replicas
from r3trace.eplb.homing import capped_counts, expert_nodes
from r3trace.eplb.leveling import level_refine
from r3trace.eplb.placement import Cluster, Placement, PlacementError, from_phy2log
from r3trace.eplb.refine import swap_refine
from r3trace.eplb.reseat import reseat
from r3trace.eplb.score import even_gpu_load, node_counts


@dataclass(frozen=True)
class PlannerConfig:
    # Weight of the newest window (0.35 averages ~5 windows). Chosen on synthetic seeds 5 and 7 (16 rolling
    # windows of 16K tokens), not on the bench's seed 3: 0.35 beat 0.5 in all five cells tried, by 0.001-0.005
    # held out (s = 0.3 on 18 nodes: +0.0314 vs +0.0239 over global); 0.25 was better still at s = 0.3 only.
    ema_alpha: float = 0.35
    home_slack: float = 0.0  # home node only when no heavier than the lightest; 0.02-0.05 lost 0.3-1 point
    fresh_swaps: int = 32  # swaps after a fresh plan (a layer stops early once a swap gains < min_gain)
    replan_swap_share: float = 0.05  # slots a kept layer's swaps may move (2 per swap): 7 swaps on 288 slots
    min_gain: float = 0.002  # of the mean GPU load: smaller gains are noise in the next window
    keep_tolerance: float = 0.06  # re-place a layer only for a >6% lower forecast max GPU load
    churn_budget: float = 0.08  # share of all L*P slots one re-plan may move (goal: <= 10%)
    spread_by_affinity: bool = True  # groups % N != 0: group homes + co-activation replicas (affinity.py)
    level_swaps: int = 150  # leveling swaps after a fresh spread plan (layers stop at level_min_gain)
    level_min_gain: float = 1e-4  # of the squared mean GPU load; 1e-3 lost 0.002-0.004 held out
    level_cold: float = 0.5  # lone replicas below this x the mean slot load may leave their group's nodes
    seeded_churn_budget: float = 0.095  # spread layout: reseated counts + leveling swaps (goal: <= 10%)

    def __post_init__(self) -> None:
        if not 0 < self.ema_alpha <= 1 or min(self.keep_tolerance, self.home_slack, self.min_gain) < 0:
            raise PlacementError(f"ema_alpha={self.ema_alpha} must be in (0, 1]; tolerances must be >= 0")


def forecast(history: np.ndarray, alpha: float) -> np.ndarray:
    """[W, L, E] or [L, E] loads -> [L, E] EMA forecast of the next window (in the last window's scale)."""
    h = np.asarray(history, dtype=np.float64)
    if h.ndim == 2:
        return h
    rates = h / np.maximum(h.sum(-1, keepdims=True), 1e-12)
    f = rates[0]
    for r in rates[1:]:
        f = alpha * r + (1 - alpha) * f
    return f * h[-1].sum(-1, keepdims=True)


def limit_binds(cluster: Cluster) -> bool:
    """True when only whole groups per node keep a token within the node limit (and they fit: groups % N == 0)."""
    return cluster.node_limit < cluster.num_nodes and cluster.num_groups % cluster.num_nodes == 0


def spreads(cluster: Cluster, cfg: PlannerConfig) -> bool:
    """True for the layout of affinity.py: groups do not fit nodes (groups % N != 0) and N >= groups."""
    return (cfg.spread_by_affinity and cluster.num_groups % cluster.num_nodes != 0
            and cluster.num_groups <= cluster.num_nodes)


class Layout(NamedTuple):
    """The layout fresh_plan builds on a cluster, and why, for reports (`r3trace eplb` prints it)."""

    name: Literal["spread", "groups_on_nodes", "expert_per_node"]
    reason: str


def layout(cluster: Cluster, cfg: PlannerConfig = PlannerConfig()) -> Layout:
    """Which of fresh_plan's layouts this cluster gets; fresh_plan branches on it."""
    g, n, lim = cluster.num_groups, cluster.num_nodes, cluster.node_limit
    if spreads(cluster, cfg):
        return Layout("spread", f"{g} groups do not fill {n} nodes evenly (groups % nodes != 0, nodes >= groups): "
                                "group home nodes, extra replicas beside the experts they are chosen with")
    if limit_binds(cluster):
        return Layout("groups_on_nodes", f"node limit {lim} < {n} nodes and {g} groups divide over them: whole "
                                         "groups per node (DeepSeek's hierarchical layout) keep tokens within it")
    why = f"node limit {lim} >= {n} nodes" if lim >= n else f"{g} groups do not divide over {n} nodes"
    return Layout("expert_per_node", f"{why}: each expert's replicas on one node, nodes balanced")


def _coact(tokens: np.ndarray | None, n_layers: int, e: int) -> np.ndarray:
    return np.zeros((n_layers, e, e)) if tokens is None or not len(tokens) else coactivation_counts(tokens, e)


def fresh_plan(w: np.ndarray, home: np.ndarray, cluster: Cluster, cfg: PlannerConfig,
               tokens: np.ndarray | None = None) -> Placement:
    """Forecast loads w [L, E], preferred nodes home [L, E], tokens [T, L, K] or None -> Placement with one
    node per expert, or group homes plus co-activation replicas where groups do not fit nodes."""
    n_layers, e = w.shape
    kind = layout(cluster, cfg).name
    if kind == "spread":
        logcnt = capped_counts(w, cluster.num_slots, cluster.num_nodes)
        cnt = affinity_replicas(w, logcnt, home_primaries(w, cluster), _coact(tokens, n_layers, e), cluster)
        phy2log = level_refine(pack_nodes(w, logcnt, cnt, cluster), w, logcnt, cluster, cfg.level_swaps,
                               cfg.level_min_gain, cfg.level_cold)
        return from_phy2log(phy2log, e)
    if kind == "groups_on_nodes":  # groups stay on their nodes: DeepSeek's hierarchical policy, then swaps in nodes
        pl = hierarchical(w, cluster)
        return from_phy2log(swap_refine(pl.phy2log, w, pl.logcnt, cluster, cfg.fresh_swaps, cfg.min_gain,
                                        cross_nodes=False), e)
    logcnt = capped_counts(w, cluster.num_slots, cluster.gpus_per_node)
    node = expert_nodes(w, logcnt, home, cluster, cfg.home_slack)
    cnt = np.zeros((n_layers, e, cluster.num_nodes), dtype=np.int64)
    cnt[np.arange(n_layers)[:, None], np.arange(e)[None, :], node] = logcnt
    split = (cnt.sum(1) != cluster.slots_per_node).any(1)  # [L] replica counts that no node split fits
    if split.any():  # e.g. counts 3, 3, 2 on two 4-slot nodes: replicas spread over nodes (cross-node layout)
        cnt[split] = spread_replicas(w[split], logcnt[split], group_nodes(w[split], cluster), cluster)
    phy2log = swap_refine(pack_nodes(w, logcnt, cnt, cluster), w, logcnt, cluster, cfg.fresh_swaps, cfg.min_gain)
    return from_phy2log(phy2log, e)


def plan(
    loads: np.ndarray,
    cluster: Cluster,
    prev: Placement | None = None,
    tokens: np.ndarray | None = None,
    cfg: PlannerConfig = PlannerConfig(),
) -> Placement:
    """loads [W, L, E] (oldest first) or [L, E]; prev Placement or None -> Placement.

    tokens [T, L, K] (the newest window's routes) place extra replicas by co-activation where groups do not
    fit nodes (affinity.py); elsewhere they are unused: packing by replayed dispatch over-fitted a
    2,048-token sample (0.887 vs 0.934 held out), and with one node per expert the dispatcher's load is
    the even-split load anyway.
    """
    w = forecast(loads, cfg.ema_alpha)
    if prev is not None and spreads(cluster, cfg):
        return from_phy2log(seeded_plan(w, prev, cluster, cfg, tokens), w.shape[1])
    home = group_nodes(w, cluster) if prev is None else node_counts(prev, cluster).argmax(2)
    fresh = fresh_plan(w, home, cluster, cfg, tokens)
    if prev is None:
        return fresh
    swaps = int(cfg.replan_swap_share * cluster.num_slots / 2)
    kept = swap_refine(prev.phy2log, w, prev.logcnt, cluster, swaps, cfg.min_gain,
                       cross_nodes=not limit_binds(cluster))
    new_max = even_gpu_load(fresh, w, cluster).max(1)
    prev_max = even_gpu_load(Placement(kept, prev.log2phy, prev.logcnt), w, cluster).max(1)  # log2phy unused
    budget = int(cfg.churn_budget * kept.size) - int((kept != prev.phy2log).sum())
    gain = prev_max / new_max  # [L]
    for layer in np.argsort(-gain, kind="stable"):  # biggest gains first, while the churn budget lasts
        if gain[layer] <= 1 + cfg.keep_tolerance:
            break
        moved = _align(fresh.phy2log[layer], prev.phy2log[layer], cluster)
        cost = int((moved != prev.phy2log[layer]).sum()) - int((kept[layer] != prev.phy2log[layer]).sum())
        if cost <= budget:
            kept[layer] = moved
            budget -= cost
    return from_phy2log(kept, w.shape[1])


def seeded_plan(w: np.ndarray, prev: Placement, cluster: Cluster, cfg: PlannerConfig,
                tokens: np.ndarray | None = None) -> np.ndarray:
    """Forecast w [L, E], previous placement -> phy2log [L, P]: the fresh replica counts reseated into prev
    (reseat.py), then leveling swaps with what is left of the churn budget, spread evenly over layers.

    Where the counts alone would move more than the budget, layers take them in order of the largest drop
    in forecast max load per replica and the rest keep their previous counts.
    """
    n_layers, e = w.shape
    logcnt = capped_counts(w, cluster.num_slots, cluster.num_nodes)
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
    phy2log = reseat(prev.phy2log, logcnt, w, _coact(tokens, n_layers, e), cluster)
    swaps = int(budget - moved.sum()) // (2 * n_layers)
    return level_refine(phy2log, w, logcnt, cluster, swaps, cfg.level_min_gain, cfg.level_cold)


def _align(new: np.ndarray, prev: np.ndarray, cluster: Cluster) -> np.ndarray:
    """One layer [P]: relabel new's GPUs inside each node and order slots so as many as possible match prev."""
    spg, gpn = cluster.slots_per_gpu, cluster.gpus_per_node
    out = np.empty_like(new)
    for node in range(cluster.num_nodes):
        gpus = range(node * gpn, (node + 1) * gpn)
        new_sets = [new[g * spg:(g + 1) * spg] for g in gpus]
        prev_sets = [prev[g * spg:(g + 1) * spg] for g in gpus]
        overlap = np.array([[len(np.intersect1d(a, b)) for b in prev_sets] for a in new_sets])
        target = [-1] * gpn
        for _ in range(gpn):  # greedy matching, largest overlap first
            a, b = np.unravel_index(np.argmax(overlap), overlap.shape)
            target[int(a)] = int(b)
            overlap[a, :] = -1
            overlap[:, b] = -1
        for i, tgt in enumerate(target):
            old = list(prev_sets[tgt])
            slots = [-1] * spg
            rest = []
            for x in new_sets[i]:
                if x in old and slots[old.index(x)] == -1:
                    slots[old.index(x)] = x
                    old[old.index(x)] = -2  # a duplicate replica must take another slot
                else:
                    rest.append(x)
            free = [s for s in range(spg) if slots[s] == -1]
            for s, x in zip(free, rest, strict=True):
                slots[s] = x
            g = node * gpn + tgt
            out[g * spg:(g + 1) * spg] = slots
    return out
