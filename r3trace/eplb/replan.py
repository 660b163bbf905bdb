"""Re-plans of the multi-node layout from a previous placement: seeded (few slots move) and, for a drifting
workload, refreshed (layers a fresh plan lowers take it). planner.plan calls them; its docstring, step 5, says why.

Which layers a drifting re-plan seeds: a seeded layer that takes the fresh plan anyway was wasted work (reseating
and leveling were 0.09 of a 0.21 s drifting re-plan at [58, 256] on 8 nodes). Over the fast-drift cells of
bench/eplb_matrix.py (504 layer re-plans, 84 drifting re-plans) every layer whose max-load floor (max_load_floor,
with the seeded plan's counts) sat below 1.5x the mean GPU load lost to the fresh plan, by 1.6% at least (mean
9%), and every re-plan holding such a layer refreshed. Only where the hottest replicas alone set the max load
(floor >= 1.5x the mean: s = 1.2 on 18 nodes, 2 slots a GPU) did seeded layers come within 1.3% of the floor, as
close as fresh ones, and those re-plans kept the seeded plan (mean ratio 1.007-1.013 <= 1 + refresh_gain). So a
drifting re-plan seeds the layers whose floor is above (1 + refresh_floor) x the mean GPU load, and a probe of the
others: the 1 / refresh_probe whose previous placement is closest to the fresh plan. Where every probe loses to
the fresh plan and their mean ratio, standing in for the unseeded layers', calls a refresh, the unseeded layers
take the fresh plan; else every layer is seeded and decides as before. Plans equal those of seeding every layer
first (refresh_floor = -1) in all of bench/eplb_matrix.py's 124 cells and on 675 saved re-plans at [16 and 58,
256]; the drifting re-plan at [58, 256] took 0.065 s instead of 0.105 s on 8 nodes (--plan-time).

The gain a drifting re-plan needs is refresh_gain averaged over layers with 0 in the floor-bound ones of two slots a
GPU: there both plans sit near the floor, so the forecast max load hides what the fresh plan's sorted pairing
(pairing.py: the heaviest replica with the lightest, which a budgeted re-plan cannot keep) gains on the other GPUs
(144 GPUs / 18 nodes / 288 slots, independent router, s = 1.2, fast drift: seeded / fresh 1.004-1.013 in sample,
so it kept the seeded plan, 0.0068 under global on the newest window held out; refreshed, 0.0014 under). Over
bench/eplb_matrix.py's 118 cells 70 / 43 / 5 -> 71 / 43 / 4 (that cell no -> tie, the same router's slow-drift cell
tie -> yes); the 9 cells it changed (all 144 / 18 / 288 but one 128 / 16 / 256, where the backtest calls drift)
moved -0.0000 .. +0.0054, mean churn 7-8% -> 17-57% a re-plan (those drifting re-plans are not churn-budgeted).
With more slots a GPU too, the drifting re-plan at [58, 256] on 64 GPUs / 8 nodes (P = E) refreshed and took 0.24x
of DeepSeek's default call instead of 0.15x (--plan-time), with no cell of the matrix changed.

Shape legend: L layers, E experts, P slots, G GPUs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from r3trace.eplb.affinity import COACT_TOKENS, CoChoices
from r3trace.eplb.alignment import align
from r3trace.eplb.candidates import nodes_per_token
from r3trace.eplb.churn_budget import seeded_counts
from r3trace.eplb.cover import cover_sizes, node_masks
from r3trace.eplb.deepseek import global_phy2log
from r3trace.eplb.descent import hot_swaps
from r3trace.eplb.emax import emax_swaps, layout_bound, layout_bounds
from r3trace.eplb.leveling import level_refine, noise_gain
from r3trace.eplb.node_cover import EXACT_COVER_NODES
from r3trace.eplb.pairing import paired, sorted_pairs
from r3trace.eplb.placement import Cluster, Placement, from_phy2log
from r3trace.eplb.reseat import reseat
from r3trace.eplb.score import node_limited, phy2log_gpu_load

if TYPE_CHECKING:
    from r3trace.eplb.candidates import Contest
    from r3trace.eplb.config import PlannerConfig


def seeded_plan(w: np.ndarray, prev: Placement, cluster: Cluster, cfg: PlannerConfig, cap: int,
                tokens: np.ndarray | None = None, layers: np.ndarray | None = None, hot: bool = True,
                counts: tuple[np.ndarray, np.ndarray] | None = None, glob: np.ndarray | None = None,
                dev: np.ndarray | None = None, noise: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Forecast w [L, E], previous placement -> phy2log [L, P]: seeded_counts' counts reseated into prev
    (reseat.py), then leveling swaps with what is left of the churn budget (seeded_counts' split over layers); a layer
    keeps its swaps only where they lower its hottest GPU by more than replan_min_drop; with two slots per GPU the
    slots the swaps left of a layer's budget then re-pick GPUs' lighter replicas (pairing.paired), and what is left
    after that goes to swaps on the hottest GPUs' loads (descent.hot_swaps; hot=False: none). layers [L] bool:
    only those rows are planned (each the same as with every layer: counts and swaps are decided over all layers), the
    others keep prev's. counts: seeded_counts' result, glob: DeepSeek global's phy2log [L, P] on w (every layer), where
    the caller has them. dev [R, L, E]: the windows' spread (scenarios.spread) the leveling lowers with the forecast's
    squares, or None. noise (a [L], b [L]): with two slots per GPU, the next window's load variance a u + b u^2 of a
    replica of load u (emax.variance_model); then the budget after reseating goes to emax.emax_swaps instead of the
    leveling, pairing and hot swaps (emax.py says why), or with P = E, what those left of it."""
    e = w.shape[1]
    logcnt, shares = seeded_counts(w, prev, cluster, cfg, cap) if counts is None else counts
    out = prev.phy2log.copy()
    rows = np.arange(len(w)) if layers is None else np.flatnonzero(layers)
    if not len(rows):
        return out
    swaps = shares[rows]  # [R]
    co = CoChoices(None if tokens is None else tokens[-COACT_TOKENS:, rows], e)  # the planned layers' tokens only
    ph = reseat(prev.phy2log[rows], logcnt[rows], w[rows], co.rows, cluster)
    if noise is not None and cluster.num_slots > e:
        out[rows] = emax_swaps(ph, w[rows], cluster, swaps, noise[0][rows], noise[1][rows], cfg.min_gain)
        return out
    cold: float | np.ndarray = cfg.level_cold
    if tokens is not None and crosses(cluster, cfg):  # [l] any replica may cross nodes where nodes per token is low
        glob_rows = global_phy2log(w[rows], cluster) if glob is None else glob[rows]  # a layer's own: rows alike
        slack = node_slack(ph, glob_rows, tokens[-SLACK_TOKENS:, rows], w.shape[1], cluster)
        cold = np.where(slack > cfg.cross_slack, np.inf, cold)
    gain = noise_gain(cfg.replan_level_min_gain, w, cluster, cfg.level_gain_count)
    leveled = level_refine(ph, w[rows], logcnt[rows], cluster, swaps, gain, cold,
                           spread=None if dev is None else dev[:, rows])
    before = phy2log_gpu_load(ph, w[rows], cluster).max(1)
    after = phy2log_gpu_load(leveled, w[rows], cluster).max(1)
    better = after < before * (1 - cfg.replan_min_drop)
    out[rows] = np.where(better[:, None], leveled, ph)
    # two slots per GPU: the slots the leveling left of the layer's budget re-pick GPUs' lighter replicas (pairing.py)
    left = 2 * swaps - (out[rows] != ph).sum(1)
    out[rows] = paired(out[rows], w[rows], cluster, None if tokens is None else tokens[:, rows], left)
    # what is still left of the layer's budget: swaps on its hottest GPUs' loads (descent.py)
    left = 2 * swaps - (out[rows] != ph).sum(1)
    # where the hottest replicas alone set the max load (floor_bound), the rest of the hottest GPU is all a swap can
    # lower, by less than hot_min_drop a swap: such layers take drops above floor_hot_drop (PlannerConfig says why);
    # with two slots per GPU the pairing above already picked the hottest replica's companion
    bound = floor_bound(w[rows], logcnt[rows], cluster, cfg.refresh_floor) & (cluster.slots_per_gpu > 2)
    drop = np.where(bound, cfg.floor_hot_drop, cfg.hot_min_drop)
    out[rows] = hot_swaps(out[rows], w[rows], logcnt[rows], cluster, left // 2, drop, cfg.level_cold,
                          cfg.hot_gpus if hot else 0)
    if noise is not None:  # P = E: the rest of the budget on E[max] swaps (emax.py's P = E paragraph)
        left = 2 * swaps - (out[rows] != ph).sum(1)
        roam = np.full(len(rows), -np.inf)
        if tokens is not None:
            glob_rows = global_phy2log(w[rows], cluster) if glob is None else glob[rows]
            slack = node_slack(out[rows], glob_rows, tokens[-SLACK_TOKENS:, rows], w.shape[1], cluster)
            roam = np.where(slack > cfg.emax_node_slack, cfg.level_cold / cluster.slots_per_gpu, -np.inf)
        out[rows] = emax_swaps(out[rows], w[rows], cluster, left // 2, noise[0][rows], noise[1][rows], 0.0, roam,
                               cfg.emax_step_drop)
    return out


# newest tokens node_slack counts on: a plan's nodes per token sits near 3-4 on 4-8 nodes, so the estimate's
# standard error (~0.05 at 512 tokens) is well under the 10% cross_slack margin (all 4,096 tokens of a window gave
# bench/eplb_matrix.py's cells the same verdict counts)
SLACK_TOKENS = 512


def crosses(cluster: Cluster, cfg: PlannerConfig) -> bool:
    """True where a seeded re-plan's leveling may move any replica across nodes under slack (cross_slack): <= 8 nodes
    (the dispatcher's exact cover, node_cover.EXACT_COVER_NODES, so a layer's count is its own whatever other layers are
    planned) and > 2 slots per GPU. With two slots per GPU pairing.paired already re-picks every GPU's lighter
    replica over all nodes; there (bench/eplb_matrix.py's 16- and 18-node cells) the rule moved balancedness
    -0.0006 .. +0.0002 on average, 3-5 cells up and 1-4 down, noise."""
    return cfg.cross_slack >= 0 and cluster.num_nodes <= EXACT_COVER_NODES and cluster.slots_per_gpu > 2


def node_slack(ph: np.ndarray, glob: np.ndarray, tokens: np.ndarray, e: int, cluster: Cluster) -> np.ndarray:
    """phy2log [L, P], DeepSeek global's phy2log [L, P] on the same forecast, tokens [T, L, K] over e experts -> [L]
    1 - nodes per token of ph / that of glob: on <= 8 nodes the dispatcher's exact node cover (cover.cover_sizes,
    both layouts in one call); beyond, with every expert once (P = E) its experts' distinct nodes (the same count;
    the greedy cover took 0.38 s more a drifting re-plan at [58, 256] on 16 nodes), else the greedy cover
    (score.node_limited)."""
    n_layers = len(ph)
    if cluster.num_nodes <= EXACT_COVER_NODES:
        masks = node_masks(np.concatenate([ph, glob]), e, cluster)  # [2 L, E]
        nodes = cover_sizes(masks, tokens, cluster.num_nodes, np.tile(np.arange(n_layers), 2)).mean(1)  # [2 L]
        return 1 - nodes[:n_layers] / nodes[n_layers:]
    if cluster.num_slots == e:
        return 1 - nodes_per_token(ph, tokens, cluster) / nodes_per_token(glob, tokens, cluster)
    mine, theirs = (node_limited(from_phy2log(x, e), tokens, cluster).nodes.mean(0) for x in (ph, glob))
    return 1 - mine / theirs


def max_load_floor(w: np.ndarray, logcnt: np.ndarray, cluster: Cluster) -> np.ndarray:
    """w [L, E], counts [L, E] -> [L] a floor under the max GPU load (even split) of every placement with these
    counts: the mean GPU load, and for m = 1 .. slots per GPU, some GPU holds m of the G (m - 1) + 1 heaviest
    replicas (pigeonhole), so at least the m lightest of them, its other slots at least the lightest replica."""
    g, spg = cluster.num_gpus, cluster.slots_per_gpu
    per = np.repeat((w / logcnt).ravel(), logcnt.ravel()).reshape(len(w), -1)  # [L, P] load of each replica
    r = -np.sort(-per, axis=1)  # [L, P] heaviest first
    floor = w.sum(1) / g
    for m in range(1, spg + 1):
        top = g * (m - 1) + 1
        floor = np.maximum(floor, r[:, top - m:top].sum(1) + (spg - m) * r[:, -1])
    return floor


def over(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, bound: np.ndarray) -> float:
    """phy2log [L, P] on the forecast w [L, E], a max GPU load per layer bound [L] (max_load_floor's, or another
    plan's) -> the mean over layers of phy2log's max GPU load (even split) / bound; a layer of no load (SGLang's
    counts hold dense layers as zero rows) meets its bound of 0: ratio 1."""
    top = phy2log_gpu_load(phy2log, w, cluster).max(1)
    return float(np.divide(top, bound, out=np.ones_like(top, dtype=np.float64), where=bound > 0).mean())


def floor_bound(w: np.ndarray, logcnt: np.ndarray, cluster: Cluster, margin: float) -> np.ndarray:
    """w [L, E], counts [L, E] -> [L] True where the max-load floor exceeds (1 + margin) x the mean GPU load: the
    hottest replicas, not the packing, set the max load there, so a seeded plan can come as close as a fresh one."""
    return max_load_floor(w, logcnt, cluster) > (1 + margin) * w.sum(1) / cluster.num_gpus


def refreshed(fresh: Contest, w: np.ndarray, prev: Placement, cluster: Cluster, cfg: PlannerConfig, cap: int,
              tokens: np.ndarray | None = None, capped: np.ndarray | None = None,
              glob: np.ndarray | None = None, noise: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """A drifting workload's re-plan: a fresh plan (its per-layer layout choice, candidates.Contest) and the
    previous placement on the forecast w [L, E] -> phy2log [L, P]. The seeded plan's layers (seeded_plan) stay,
    except that where the fresh plan's forecast max GPU load is lower by more than refresh_gain on average over
    layers, every layer it lowers takes the fresh layout (aligned to prev so that kept replicas stay in their
    slots). The fresh layout is chosen only in the layers that take it or whose max load depends on the choice.

    Seeded first: the floor-bound layers (floor_bound) and, of the others, the 1 / refresh_probe whose previous
    placement is closest to the fresh plan (a probe). Where every probe loses to the fresh plan and the probes'
    mean ratio, standing in for the unseeded layers', calls a refresh, those layers take the fresh layout unseeded;
    else every layer is seeded and the rule above decides (module doc). Seeded without hot swaps (descent.py says
    why). capped: the fresh counts (homing.capped_counts), glob: DeepSeek global's phy2log [L, P] on w, where the
    caller has them. noise (a [L], b [L]): with two slots per GPU and a spare slot, emax.variance_model's terms; the
    seeded layers then take E[max] swaps within their budget in place of leveling and pairing (as a still re-plan's,
    seeded_plan), and the layers that take the fresh layout up to drift_emax_swaps of them before alignment."""

    def fresh_rows(take: np.ndarray) -> np.ndarray:  # [R] layers -> their fresh layouts [R, P], aligned to prev
        ph = fresh.layouts(take)
        if noise is not None:
            ph = emax_swaps(ph, w[take], cluster, np.full(len(take), cfg.drift_emax_swaps), noise[0][take],
                            noise[1][take], cfg.min_gain)
        return align(ph, prev.phy2log[take], cluster)

    peak = fresh.peak()  # [L]
    counts = seeded_counts(w, prev, cluster, cfg, cap, capped)
    seed = floor_bound(w, counts[0], cluster, cfg.refresh_floor)  # [L]
    # the gain a refresh needs, over layers: none in floor-bound ones with two slots a GPU (module doc); those that
    # stay seeded end in sorted pairs (resorted)
    flat = seed & (cluster.slots_per_gpu == 2)  # [L]
    gain = float(np.where(flat, 0.0, cfg.refresh_gain).mean())
    rest = np.flatnonzero(~seed)
    if len(rest):
        near = phy2log_gpu_load(prev.phy2log[rest], w[rest], cluster).max(1) / peak[rest]
        probe = rest[np.argsort(near, kind="stable")[: -(-len(rest) // cfg.refresh_probe)]]
        seed[probe] = True
    low = seeded_plan(w, prev, cluster, cfg, cap, tokens, seed, hot=False, counts=counts, glob=glob, noise=noise)
    ratio = phy2log_gpu_load(low, w, cluster).max(1) / peak  # [L] unseeded rows: prev's (not read)
    if len(rest):
        est = np.where(seed, ratio, ratio[probe].mean())
        if ratio[probe].min() > 1 and est.mean() > 1 + gain:
            take = np.flatnonzero(~seed | (ratio > 1))
            low[take] = fresh_rows(take)
            return resorted(low, w, cluster, cfg, tokens, flat & (ratio <= 1), glob)
        low[~seed] = seeded_plan(w, prev, cluster, cfg, cap, tokens, ~seed, hot=False, counts=counts, noise=noise,
                                    glob=glob)[~seed]
        ratio = phy2log_gpu_load(low, w, cluster).max(1) / peak
    if ratio.mean() <= 1 + gain:
        return resorted(low, w, cluster, cfg, tokens, flat, glob)
    take = np.flatnonzero(ratio > 1)
    low[take] = fresh_rows(take)
    return resorted(low, w, cluster, cfg, tokens, flat & (ratio <= 1), glob)


def held_refresh(low: np.ndarray, fresh: Contest, w: np.ndarray, prev: Placement, cluster: Cluster,
                 cfg: PlannerConfig, noise: tuple[np.ndarray, np.ndarray],
                 glob: np.ndarray | None = None) -> np.ndarray:
    """A drifting re-plan's phy2log [L, P] (refreshed's) -> the same with each layer whose next-window E[max] bound
    (emax.layout_bound under drift_noise's variance model) the fresh layout, or DeepSeek global's (glob [L, P]), lowers
    by more than drift_bound_gain taking the lower, aligned to prev. With many slots a GPU the forecast's max load is
    at its floor in nearly every layout, so refreshed keeps stale replica counts whose few, heavy replicas swing with
    the drift next window. The fresh layout is chosen (Contest.layouts) only in the layers where one of its tied
    candidates passes: its regroups move whole GPUs between nodes, so the chosen one has a candidate's bound."""
    a, b = noise
    # the Contest's last candidate is global's layout where it competes (candidates.Contest): its bound, not again
    extra = [] if glob is None or (len(fresh.cands) > 1 and np.array_equal(fresh.cands[-1], glob)) else [glob]
    bounds = layout_bounds([low, *fresh.cands, *extra], w, cluster, a, b)  # [1 + C (+ 1), L]
    mine, each = bounds[0], bounds[1:1 + len(fresh.cands)]
    best = np.where(fresh.tied, each, np.inf).min(0)
    bg = None if glob is None else bounds[-1]
    if bg is not None:
        best = np.minimum(best, bg)
    rows = np.flatnonzero(mine > best * (1 + cfg.drift_bound_gain))
    if not len(rows):
        return low
    new = fresh.layouts(rows)
    bn = layout_bound(new, w[rows], cluster, a[rows], b[rows])
    if glob is not None and bg is not None:
        new = np.where((bg[rows] < bn)[:, None], glob[rows], new)
        bn = np.minimum(bg[rows], bn)
    take = rows[mine[rows] > bn * (1 + cfg.drift_bound_gain)]
    out = low.copy()
    out[take] = align(new[np.isin(rows, take)], prev.phy2log[take], cluster)
    return out


def resorted(low: np.ndarray, w: np.ndarray, cluster: Cluster, cfg: PlannerConfig, tokens: np.ndarray | None,
             rows: np.ndarray, glob: np.ndarray | None) -> np.ndarray:
    """A drifting re-plan's phy2log [L, P] on the forecast w [L, E], tokens [T, L, K] -> the same with the layers
    rows [L] bool (the floor-bound ones of two slots a GPU that stayed seeded) in sorted pairs
    (pairing.sorted_pairs) where their nodes per token on the newest tokens (node_slack) stays more than
    emax_node_slack under DeepSeek global's plan on w (glob [L, P] where the caller has it): the pairs move replicas
    across nodes. Without tokens: none (nodes per token unknown)."""
    idx = np.flatnonzero(rows)
    if not cfg.resort_pairs or tokens is None or not len(idx):
        return low
    cand = sorted_pairs(low[idx], w[idx], cluster, tokens[:, idx])
    moved = (cand != low[idx]).any(1)
    if not moved.any():
        return low
    idx, cand = idx[moved], cand[moved]
    ref = global_phy2log(w[idx], cluster) if glob is None else glob[idx]
    ok = node_slack(cand, ref, tokens[-SLACK_TOKENS:, idx], w.shape[1], cluster) > cfg.emax_node_slack
    low[idx[ok]] = cand[ok]
    return low
