"""Our placement planner: one node per expert, planned for the next window, migration-bounded.

1. Forecast: an exponential moving average of the per-window loads [W, L, E] (each window normalised to
   rates; weights normalised over the windows there are, smooth_rates), so one noisy window does not move
   replicas: the global policy plans on the last window alone and loses 4-6 points of balancedness on the
   next one. Its weight is picked per plan by backtest on the history (forecast.py, choose_alpha: slow drift
   wants a long memory, fast drift a short one); the same backtest says whether the workload drifts (step 5), and
   where it does not, the longest memory within `alpha_tie` of the best weight's error is taken. Without spare
   slots (> 2 a GPU) the light experts of layers whose hottest expert sets the max load take the weight that picked
   the hot GPUs' lightest partners best in the same backtest (partners.py). `r3trace eplb` also hands plan() the
   windows at the long-run mix of the kinds of token behind them (`mixed`, token_mix.py) where a backtest says they
   forecast better; the forecast takes them only where the raw history drifts (plan_forecast.py).
2. Replica counts: the global policy's rule (each extra slot to the expert with the highest load per
   replica), capped at the GPUs of one node (homing.capped_counts).
3. Layout and 4. packing: fresh.py (one node; group homes and co-activation replicas on several; global's layouts
   contesting per layer; balanced packing, swaps, leveling, polish, pairing).
5. Migration: with a previous placement, a layer is re-placed only when the fresh plan lowers its forecast
   max GPU load by more than `keep_tolerance`; otherwise the previous layer is kept and gets at most
   `replan_swap_share` of its slots in swaps (2 slots each). Layers are re-placed biggest gain first
   while the moved slots stay within `churn_budget` of all slots. A re-placed layer is aligned to the
   previous one (GPUs matched by shared experts, experts kept in their slots) so only replicas that really
   move are transferred. In the multi-node layout a re-placed layer moved 154-247 of 288 slots, so there the
   re-plan is seeded instead (seeded_plan): every layer takes its fresh counts by moving only the replicas
   whose count changed (reseat.py: 1-3 slots per layer), then leveling swaps use the rest of
   `seeded_churn_budget` (across nodes for any replica where a layer's nodes per token is `cross_slack` under
   global's), and swaps on the `hot_gpus` hottest GPUs what the leveling left (descent.py). With two slots per GPU
   and a spare slot the budget after reseating goes instead to swaps of GPUs' lighter replicas that lower a bound on
   the next window's expected max GPU load, not the forecast's max (emax.py, `emax_swaps`); without a spare slot
   what is left of the budget after the hot swaps does.
   These budgets hold for an unchanged workload; a drifting one (the backtest's plain
   mean erred > `refresh_drift` more than its best weight, over >= 2 windows; with one, the newest window moved
   more than `early_drift` x its tokens' sampling noise, early_drift.py; on two nodes without routes the backtest's
   call is held to a still re-plan with an unbudgeted static-even ladder, drift_call.py) re-plans fresh on every layer
   that lowers the forecast max GPU load, when they lower it by > `refresh_gain` on average (refreshed; in the
   multi-node layout per layer the best of ours and global's, candidates.py): on the fast-drift cells of
   bench/eplb_matrix.py a budgeted re-plan moved 9.5% of slots and trailed global on the newest window by up to
   0.04 (10 of 24 cells missed it); refreshed, 7-71% of slots a re-plan (mean per cell), 2 of 24 miss. There a
   drifting re-plan seeds only the layers whose hottest replicas set their max load (replan.py says why); with two
   slots per GPU and a spare slot its seeded layers take E[max] swaps as a still re-plan's do, and the layers taking
   the fresh layout up to `drift_emax_swaps` of them (its pairing crowds GPUs just under the max load). A still
   re-plan whose budgeted plan's forecast max load stays > `stale_gain` above a fresh plan's (the previous placement
   was made for another workload) takes the fresh plan, aligned to the previous placement. On one node, and with more
   than BOUND_SLOTS_PER_GPU slots a GPU on several, a drifting re-plan judges layouts by a bound on the next window's
   expected max GPU load as well (emax.layout_bound; PlannerConfig.drift_bound_gain has the figures): the forecast's
   max load is at its floor in nearly every such layout, and stale replica counts, few heavy replicas of an expert that
   the drift made hot, show only in the next window's spread.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeGuard

import numpy as np

from r3trace.eplb.alignment import align
from r3trace.eplb.candidates import Contest, losing_load
from r3trace.eplb.churn_budget import seeded_counts
from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.deepseek import global_phy2log, group_nodes
from r3trace.eplb.dispatch_contest import applies as replays
from r3trace.eplb.dispatch_contest import dispatch_max, drift_replay, groups_apply, replay_guard
from r3trace.eplb.drift_call import drift_call
from r3trace.eplb.emax import drift_noise, layout_bound, replan_noise
from r3trace.eplb.fresh import fresh_plan, spread_cap, spread_layout, spreads
from r3trace.eplb.homing import capped_counts
from r3trace.eplb.locality import locality_kept, locality_refresh
from r3trace.eplb.node_copies import copies_fit, copies_plan
from r3trace.eplb.node_swaps import node_swaps
from r3trace.eplb.partners import cold_forecast, coldest_partners
from r3trace.eplb.placement import Cluster, Placement, from_phy2log, within_churn
from r3trace.eplb.plan_forecast import planning_forecast
from r3trace.eplb.refine import swap_refine
from r3trace.eplb.replan import held_refresh, max_load_floor, over, refreshed, seeded_plan
from r3trace.eplb.scenarios import spread
from r3trace.eplb.score import even_gpu_load, node_counts, phy2log_gpu_load
from r3trace.eplb.static import static_expected_load
from r3trace.eplb.static_ladder import model_static_ladder, replay_ladder, static_ladder, token_ladder
from r3trace.eplb.static_one_node import keep_lower, static_one_node
from r3trace.eplb.static_spread import STATIC_EVEN_CHURN, static_even

# a drifting multi-node re-plan judges layouts by the next window's E[max] bound (replan.held_refresh) only with more
# slots a GPU than this: on 2 nodes (16-18 a GPU) the forecast's max load sits at its floor in nearly every layout, on
# 8 nodes (4-5 a GPU) it tells layouts apart (1.04-1.21 per layer under fast drift) and the bound moved the 8-node
# fast-drift cells by -0.0006 .. +0.0013 (seed 0) while costing 0.035 s a drifting re-plan at [58, 256] on 64 GPUs
# (0.044 -> 0.080 s, 0.27x the reference's 0.29 s call in that run; the plan-time goal is 0.2x); with 2 slots a GPU
# E[max] swaps run instead
BOUND_SLOTS_PER_GPU = 8


def plan(
    loads: np.ndarray,
    cluster: Cluster,
    prev: Placement | None = None,
    tokens: np.ndarray | None = None,
    cfg: PlannerConfig = PlannerConfig(),
    mixed: np.ndarray | None = None,
    demixed: np.ndarray | None = None,
) -> Placement:
    """loads [W, L, E] (oldest first) or [L, E]; prev Placement or None -> Placement.

    mixed [W, L, E]: the same windows at the long-run mix of their kinds of token (token_mix.planning_loads); where the
    backtest calls drift the forecast is the EMA of these, its weight picked by how well it forecast the raw windows;
    the drift test and every other use of the history read the raw `loads` (planning_forecast says why).
    demixed [W, L, E]: the windows at their long-run mix whichever source the caller's backtest picked
    (token_mix.Source.demixed); a re-plan on three windows tests drift on them against the tokens' noise
    (early_drift.py), not without them.

    tokens [T, L, K] (the newest window's routes) place extra replicas by co-activation where groups do not
    fit nodes (affinity.py); elsewhere they are unused: packing by replayed dispatch over-fitted a
    2,048-token sample (0.887 vs 0.934 held out), and with one node per expert the dispatcher's load is
    the even-split load anyway. On two nodes with spare slots they also pick layouts by node-limited replay
    (dispatch_contest.py): a fresh plan's and a drifting re-plan's global layouts, a still re-plan's layers kept
    from `prev`, and a fresh or still plan's static-even rungs in the layers replay skews (static_ladder.token_ladder).
    """
    if copies_fit(cluster, loads.shape[-1], cfg):  # every node the same one-node plan (node_copies.py)
        return copies_plan(plan, loads, cluster, prev, tokens, cfg, mixed, demixed)
    call = drift_call(loads, prev is not None, cfg, tokens, demixed, cluster)
    fc = planning_forecast(loads, prev, cfg, cluster, mixed, tokens, demixed, call)
    # a drifting multi-node re-plan's global layout: its layers' contest (_plan) and the two-node replay's (below)
    drifting = fc[1] and _reseeds(prev, cluster, cfg)
    glob = global_phy2log(fc[0], cluster) if drifting else None
    out = _plan(loads, cluster, prev, tokens, cfg, fc, glob, mixed)
    e = out.logcnt.shape[1]
    mean_loads = loads.sum(0) if loads.ndim == 3 else loads  # [L, E] what DeepSeek global plans on: the summed loads
    if cfg.hot_partners and cluster.slots_per_gpu == 2 and cluster.num_slots == e:  # partners.coldest_partners
        cold = cold_forecast(loads, fc[0], cluster, cfg.partner_light)
        out = from_phy2log(coldest_partners(out.phy2log, fc[0], cluster, cfg.hot_partners, cold), e)
    if cfg.static_even and cluster.num_nodes > 1:
        return from_phy2log(_static_even_plan(out.phy2log, loads, mean_loads, cluster, prev, tokens, cfg, fc, mixed),
                            e)
    if cfg.static_even and cfg.sglang_dispatch == "static":  # one node: counts that divide the GPUs
        # (static_one_node.py); dynamic dispatch's uniform draw already splits evenly there in expectation
        return from_phy2log(keep_lower(out.phy2log, static_one_node(out.phy2log, fc[0], cluster), fc[0], cluster), e)
    if cfg.keep_groups and prev is not None and groups_apply(cluster, cfg.replay_margin):
        # a re-plan's layer whose node-limited max load is worse than the previous one's keeps the previous layer (it
        # may hold hierarchical's layout from a fresh plan's groups_contest, which the even-split swaps would undo);
        # only the layers the re-plan changed are dispatched (a budgeted re-plan moves <= 8% of slots)
        moved = (out.phy2log != prev.phy2log).any(1)  # [L]
        if not moved.any():
            return out
        new, old = dispatch_max([out.phy2log[moved], prev.phy2log[moved]], fc[0][moved], cluster,
                                None if tokens is None else tokens[:, moved], cfg.router)
        keep = np.zeros(len(moved), dtype=bool)
        keep[moved] = new > old * (1 + cfg.replay_margin)
        return from_phy2log(np.where(keep[:, None], prev.phy2log, out.phy2log), e)
    if not spreads(cluster, cfg) or cfg.keep_groups or not replays(cluster, e, cfg.replay_margin):
        return out
    # experts made static-even (an expert's replicas all on one node or one a node) as far as global's nodes per token
    # allows, the ladder's layouts scored by node-limited replay of the newest tokens (static_ladder.token_ladder) or
    # without them by a router model's expected node-limited loads (replay_ladder); a still re-plan's laddered layers
    # within its churn budget, a fresh plan's, a drifting re-plan's and a held one's (not churn-budgeted) all
    churn_from = None if prev is None or fc[1] or call.held else prev.phy2log
    if tokens is None:
        return from_phy2log(replay_ladder(out.phy2log, fc[0], cluster, mean_loads, cfg.router, churn_from,
                                          cfg.seeded_churn_budget), e)
    if prev is None:
        phy2log = out.phy2log
    elif glob is not None:  # drifting: every layer contested against global's, as a fresh plan's layers are
        return from_phy2log(drift_replay(out.phy2log, glob, prev.phy2log, cluster, tokens, cfg.replay_margin), e)
    else:
        phy2log = replay_guard(out.phy2log, prev.phy2log, cluster, tokens, cfg.replay_margin)
    return from_phy2log(token_ladder(phy2log, fc[0], cluster, tokens, mean_loads, churn_from,
                                     cfg.seeded_churn_budget), e)


def _static_even_plan(new: np.ndarray, loads: np.ndarray, mean_loads: np.ndarray, cluster: Cluster,
                      prev: Placement | None, tokens: np.ndarray | None, cfg: PlannerConfig,
                      fc: tuple[np.ndarray, bool], mixed: np.ndarray | None = None) -> np.ndarray:
    """new [L, P], plan()'s layout -> it made static-even (static_spread.py), with tokens as far as DeepSeek global's
    nodes per token allows (static_ladder.py). A drifting re-plan refreshed the layers
    whose fresh layout beat the seeded one on the forecast, but static-even costs the previous placement's seeded
    layers some of that max load, so nearly every layer refreshed every time (85% of slots a re-plan on 32 GPUs /
    4 nodes, independent router, s = 1.2, slow drift): there the still re-plan, made static-even too, is kept unless
    the refreshed one's forecast max GPU load under static dispatch is lower by more than refresh_gain on average
    over layers. mean_loads [L, E]: the windows' summed loads; fc: planning_forecast's (w, moving) for cfg."""
    w, moving = fc

    def finish(phy2log: np.ndarray, still: bool) -> np.ndarray:  # still: a re-plan within the churn budget
        if tokens is None and cluster.num_nodes == 2:  # nodes per token from the router model
            churn_from = prev.phy2log if still and prev is not None else None
            return model_static_ladder(phy2log, w, cluster, mean_loads, cfg.router, cfg.sglang_dispatch, churn_from,
                                       cfg.seeded_churn_budget + STATIC_EVEN_CHURN)
        if tokens is None:
            return static_even(phy2log, w, cluster)
        return static_ladder(phy2log, w, cluster, tokens, mean_loads, cfg.sglang_dispatch)

    out = finish(new, not moving)
    if prev is None or not moving or cluster.num_slots == loads.shape[-1]:  # P = E: nothing to make static-even, so
        # the refreshed plan costs no max load (and keeps locality.locality_refresh's layers)
        return out
    still_cfg = replace(cfg, refresh_drift=float("inf"), early_drift=0.0)
    still = finish(_plan(loads, cluster, prev, tokens, still_cfg, mixed=mixed).phy2log, True)
    how = cfg.sglang_dispatch
    gain = (static_expected_load(still, w, cluster, dispatch=how).max(1)
            / static_expected_load(out, w, cluster, dispatch=how).max(1))  # [L]
    return out if float(gain.mean()) > 1 + cfg.refresh_gain else still


def _replan_swaps(phy2log: np.ndarray, w: np.ndarray, cluster: Cluster, cfg: PlannerConfig,
                  tokens: np.ndarray | None) -> np.ndarray:
    """A re-plan's phy2log [L, P] without tokens (P = E) -> the same after one round of node swaps saving more than
    replan_swap_gain each (node_swaps.py): the seeded moves' drift off the gathered nodes taken back."""
    if tokens is not None or cfg.replan_swap_gain <= 0:
        return phy2log
    return node_swaps(phy2log, w, cluster, *cfg.router, cfg.node_swap_cap, max_rounds=1, pair_swaps=1,
                      min_gain=cfg.replan_swap_gain)


def _reseeds(prev: Placement | None, cluster: Cluster, cfg: PlannerConfig) -> TypeGuard[Placement]:
    """Whether _plan re-plans multi-node style: from a previous placement in the spread layout (not keep_groups),
    seeded when still and refreshed with global's layout contesting every layer when drifting."""
    return prev is not None and spreads(cluster, cfg) and not cfg.keep_groups


def _plan(loads: np.ndarray, cluster: Cluster, prev: Placement | None, tokens: np.ndarray | None,
          cfg: PlannerConfig, fc: tuple[np.ndarray, bool] | None = None, glob: np.ndarray | None = None,
          mixed: np.ndarray | None = None) -> Placement:
    """plan() before the two-node replay steps (guard, drift contest); fc: planning_forecast's (w, moving) for cfg,
    where made; glob: DeepSeek global's phy2log [L, P] on w, where made (a drifting re-plan's); mixed: plan()'s."""
    w, moving = planning_forecast(loads, prev, cfg, cluster, mixed, tokens) if fc is None else fc
    if _reseeds(prev, cluster, cfg):
        cap = spread_cap(cluster)
        if not moving:
            dev = spread(loads, w, cfg.spread_windows) if cluster.slots_per_gpu > 2 else None
            noise = replan_noise(loads, w, cluster) if cfg.emax_swaps else None
            capped = capped_counts(w, cluster.num_slots, cap)  # the fresh counts: reseated, and the stale floor's
            seeded = seeded_plan(w, prev, cluster, cfg, cap, tokens, dev=dev, noise=noise,
                                 counts=seeded_counts(w, prev, cluster, cfg, cap, capped))
            limit = 1 + cfg.stale_gain
            floor = max_load_floor(w, capped, cluster)
            if cfg.stale_gain >= 0 and over(seeded, w, cluster, floor) > limit:  # a fresh plan only then
                again = fresh_plan(w, None, cluster, cfg, tokens).phy2log
                if over(seeded, w, cluster, phy2log_gpu_load(again, w, cluster).max(1)) > limit:
                    return from_phy2log(align(again, prev.phy2log, cluster), w.shape[1])
            # the seeded plan fits: finished as every still re-plan is
            return from_phy2log(_replan_swaps(locality_kept(seeded, prev, w, cluster, cfg, tokens), w, cluster,
                                              cfg, tokens), w.shape[1])
        # the fresh plan here is a full move anyway, so global's layout competes for every layer (candidates.py),
        # each layer's choice made only where the re-plan needs it (candidates.Contest)
        glob = global_phy2log(w, cluster) if glob is None else glob
        capped = capped_counts(w, cluster.num_slots, cap)
        ours = spread_layout(w, cluster, cfg, tokens, losing_load(glob, w, cluster), capped)
        anew = Contest(ours, w, cluster, tokens, glob=glob, router=cfg.router, swap_cap=cfg.node_swap_cap)
        noise = replan_noise(loads, w, cluster) if cfg.emax_swaps and cluster.num_slots > w.shape[1] else None
        out = refreshed(anew, w, prev, cluster, cfg, cap, tokens, capped, glob, noise)
        drift = (drift_noise(loads, w) if cfg.drift_bound_gain >= 0 and cluster.slots_per_gpu > BOUND_SLOTS_PER_GPU
                 else None)
        if drift is not None:
            out = held_refresh(out, anew, w, prev, cluster, cfg, drift, glob)
        # the seeded layers' own few swaps first, so a fresh layout is taken for locality where it is better than
        # they can be made, not for being another layout of the swaps
        out = locality_refresh(_replan_swaps(out, w, cluster, cfg, tokens), anew, w, prev, cluster, cfg, tokens, glob)
        return from_phy2log(locality_kept(out, prev, w, cluster, cfg, tokens, glob), w.shape[1])
    home = group_nodes(w, cluster) if prev is None else node_counts(prev, cluster).argmax(2)
    fresh = fresh_plan(w, home, cluster, cfg, tokens)
    if prev is None:
        return fresh
    swaps = int(cfg.replan_swap_share * cluster.num_slots / 2)
    kept = swap_refine(prev.phy2log, w, prev.logcnt, cluster, swaps, cfg.min_gain, cross_nodes=not cfg.keep_groups)
    new_max = even_gpu_load(fresh, w, cluster).max(1)
    prev_max = even_gpu_load(Placement(kept, prev.log2phy, prev.logcnt), w, cluster).max(1)  # log2phy unused
    # a moving workload (drifts) or a previous placement that no longer fits (stale_gain) lifts the churn budget:
    # every layer that gains over keep_tolerance is re-placed
    no_fit = cfg.stale_gain >= 0 and float((prev_max / new_max).mean()) > 1 + cfg.stale_gain
    share = 1.0 if moving or no_fit else cfg.churn_budget
    budget = int(share * kept.size) - int((kept != prev.phy2log).sum())
    gain = prev_max / new_max  # [L]
    up = gain > 1 + cfg.keep_tolerance  # [L] the layers that may be re-placed, aligned at once
    noise = drift_noise(loads, w) if moving and cfg.drift_bound_gain >= 0 else None
    if noise is not None:  # drifting: also the layers whose next-window E[max] bound the fresh plan lowers
        held = layout_bound(kept, w, cluster, *noise) / layout_bound(fresh.phy2log, w, cluster, *noise)
        up |= held > 1 + cfg.drift_bound_gain
        gain = np.maximum(gain, held)
    moves = np.zeros_like(kept)
    moves[up] = align(fresh.phy2log[up], prev.phy2log[up], cluster)
    order = np.argsort(-gain, kind="stable")  # the up layers, biggest gains first, while the churn budget lasts;
    # filtered, not cut at the first layer not up: a layer up by its bound alone (gain 1.002-1.06) sorts after
    # layers not up of gains up to 1.06, and a cut there left all 3 up layers of a drifting one-node re-plan in place
    # (tests/analysis/test_eplb_drift_bound.py)
    order = order[up[order]]
    return from_phy2log(within_churn(kept, moves, prev.phy2log, order, budget), w.shape[1])

