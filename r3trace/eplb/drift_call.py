"""A plan's drift call, made once: whether a re-plan's workload moved past its churn budget (plan_forecast's `moving`),
by which test, and the figures behind it, which `r3trace eplb --previous` prints (DriftCall.note).

Two tests, on the raw history [W, L, E]: the backtest's (forecast.drifts: over >= MIN_DRIFT_FOLDS scored windows the
plain mean erred more than refresh_drift over the best EMA weight), and on three windows, where the backtest scores
one, the newest window's move against its tokens' sampling noise (early_drift.py). A fresh plan calls neither: it
has no budget to lift.

Without routes the backtest's call also needs its excess to hold window by window (`called`: forecast.excess_t >=
PlannerConfig.drift_t). Counts alone cannot be de-mixed (token_mix.py), and the grouped router draws each window's
mix of domains afresh: on a few windows the plain mean errs far more than a short memory by chance, which the summed
ratio counts as drift. Over bench/eplb_matrix.py's SGLang-dump re-plans (8-window histories, s = 0.6 and 1.2, trace
seeds 0-2; 108 a drift): slow drift (sigma 0.05) 26 ratio calls, every one at t = 0.4-1.9; fast drift (0.3) 93, 9 of
them under 2 (0.9-1.95, 8 of the 9 on 2-5 scored windows), the rest up to 17. With routes the call stands on the
ratio (PlannerConfig.drift_t has why and the held-out figures).

Held (PlannerConfig.hold_two_node_drift): on two nodes with spare slots and no routes, a backtest's call is not acted
on. The re-plan is a still one, on the still forecast (the longest memory within alpha_tie of the best weight) and the
seeded layout within the churn budget, and only its static-even ladder (static_ladder.replay_ladder, by the router
model's node-limited loads) climbs unbudgeted, as a drifting re-plan's does. Without routes nothing de-mixes the
windows (token_mix.py), and a drifting re-plan's best weight chases each window's own mix; on 18 slots a GPU the
seeded re-plan's reseating follows the counts that move. Over bench/eplb_matrix.py's SGLang-dump cells of 16 GPUs /
2 nodes / 288 slots, trace seeds 0-2 (the backtest called drift in the 6 fast-drift cells and 4 of the 6 slow-drift
ones), ours against the better global: fast drift -0.0056 -> +0.0048 a cell under the even split (every cell up,
+0.004 .. +0.016) and -0.0074 -> +0.0012 node-limited; slow drift (the 4) +0.0151 -> +0.0248 and +0.0098 -> +0.0128
(one cell -0.009 node-limited); slots moved a re-plan 17-39% -> 10-11% (fast), nodes per token up to +0.013, still
0.010 under global's. Not elsewhere: with routes the same hold lost 0.0047 a cell over the 18 fast-drift two-node cells
(their de-mixed forecast and replay contest follow the drift), and a still re-plan without routes on 4-18 nodes lost
0.0059 a cell over the 18 fast-drift cells (down to -0.020; 2-5 slots a GPU move in whole replicas) though it gained
0.01-0.02 on the slow ones whose backtest called drift (seeds 1-2: the plain mean erred up to 1.75x the best weight
there, as much as under fast drift).
Shape legend: W windows, L layers, E experts, T tokens, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.dispatch_contest import applies as replays
from r3trace.eplb.early_drift import EARLY_WINDOWS, early_ratio
from r3trace.eplb.forecast import drifts, excess_t, summed, window_errors
from r3trace.eplb.fresh import spreads
from r3trace.eplb.node_copies import copies_fit
from r3trace.eplb.placement import Cluster

# scored windows the t test needs (fewer: the ratio alone). On 2-3 of them the SGLang-dump re-plans' t overlapped
# (slow drift 0.5-1.9, fast 0.9-17, 5 fast calls under 2) and holding them lost the fast cells' first re-plans (up to
# -0.053 a window on 144 / 18 / 288); from 4 on, 22 of the 26 slow calls are held and 4 of the 93 fast ones
MIN_T_FOLDS = 4


@dataclass(frozen=True)
class DriftCall:
    cfg: PlannerConfig
    windows: int  # W; 0 for one [L, E] window
    err: np.ndarray | None  # a re-plan's forecast.backtest_errors of the raw history (None: < 3 windows, fixed weight)
    backtest: bool  # forecast.drifts on err
    ratio: float | None  # early_drift.early_ratio where the early test applies (a re-plan, early_drift > 0)
    held: bool = False  # the backtest's call held to a still re-plan (module doc: two nodes, no routes)
    t: float | None = None  # forecast.excess_t of a ratio call without routes (drift_t > 0, MIN_T_FOLDS, not held)

    @property
    def called(self) -> bool:
        """Whether the backtest calls drift: its ratio test, by at least cfg.drift_t standard errors of the per-window
        excess (module doc)."""
        return self.backtest and (self.t is None or self.t >= self.cfg.drift_t)

    @property
    def early(self) -> bool:
        """Whether the early test calls drift: its ratio over cfg.early_drift."""
        return self.ratio is not None and self.ratio > self.cfg.early_drift

    @property
    def moving(self) -> bool:
        """Whether the re-plan may move past its churn budget."""
        return (self.called or self.early) and not self.held

    def note(self) -> str:
        """The call in words: drifting, by the backtest or by the early ratio, or still, and why."""
        cfg, err, w = self.cfg, self.err, self.windows
        budget = f"within the churn budget ({cfg.seeded_churn_budget:.1%} of slots in the multi-node layout)"
        if w == 0 or cfg.ema_alpha is not None:
            return f"still: no backtest on {'one window' if w == 0 else 'a fixed EMA weight'}; {budget}"
        if self.backtest:
            assert err is not None
            called = (f"over {w - 2} scored windows the plain mean erred {err[0] / err.min():.2f}x the best EMA weight "
                      f"(> {1 + cfg.refresh_drift:.2f})")
            if self.held:
                return (f"held: {called}, but on two nodes without routes a still re-plan {budget}, its static-even "
                        f"ladder unbudgeted")
            if self.called:
                return f"drifting: {called}; layers a fresh plan lowers may move, past the churn budget"
            return (f"still: {called}, but by {self.t:.1f} standard errors of its excess a window (< "
                    f"{cfg.drift_t:g}); {budget}")
        if self.early:
            return (f"drifting: one scored window, the newest moved {self.ratio:.1f}x its tokens' sampling noise (> "
                    f"{cfg.early_drift:g}); planned on the newest window, layers a fresh plan lowers may move, past "
                    f"the churn budget")
        if self.ratio is not None:
            why = f"the newest window moved {self.ratio:.1f}x its tokens' sampling noise (<= {cfg.early_drift:g})"
        elif err is None:
            why = "fewer than 3 windows to backtest"
        elif w == EARLY_WINDOWS:
            why = "one scored window, without routes and their kinds of token (or the early test) to judge it by"
        else:
            why = (f"over {w - 2} scored windows the plain mean erred {err[0] / err.min():.2f}x the best EMA weight "
                   f"(<= {1 + cfg.refresh_drift:.2f})")
        return f"still: {why}; {budget}"


def drift_call(loads: np.ndarray, replan: bool, cfg: PlannerConfig, tokens: np.ndarray | None = None,
               demixed: np.ndarray | None = None, cluster: Cluster | None = None) -> DriftCall:
    """loads [W, L, E] or [L, E]; replan: a previous placement is given; tokens [T, L, K] the newest window's, demixed
    [W, L, E] the windows at their long-run mix (token_mix.Source.demixed); cluster: the plan's (None: no hold) -> the
    call (module doc). Only a re-plan with no fixed EMA weight is tested."""
    h = np.asarray(loads, dtype=np.float64)
    tested = replan and cfg.ema_alpha is None
    per = window_errors(h) if tested else None  # [W - 2, len(ALPHAS)]
    err = None if per is None else summed(per)
    ratio = early_ratio(h, tokens, demixed) if tested and cfg.early_drift > 0 else None
    backtest = drifts(h, err, cfg.refresh_drift)
    held = backtest and tokens is None and cluster is not None and holds(cluster, h.shape[-1], cfg)
    tested_t = not held and tokens is None and cfg.drift_t > 0 and len(h) - 2 >= MIN_T_FOLDS
    t = excess_t(per) if backtest and per is not None and tested_t else None
    return DriftCall(cfg, len(h) if h.ndim == 3 else 0, err, backtest, ratio, held, t)


def holds(cluster: Cluster, num_experts: int, cfg: PlannerConfig) -> bool:
    """Whether a backtest's drift call without routes is held on this cluster (module doc): hold_two_node_drift, the
    multi-node layout (not keep_groups, not node copies, whose layers plan on one node's slice and act on the call)
    and the two-node replay steps (dispatch_contest.applies: two nodes, spare slots, node-limited dispatch)."""
    return (cfg.hold_two_node_drift and spreads(cluster, cfg) and not cfg.keep_groups
            and not copies_fit(cluster, num_experts, cfg) and replays(cluster, num_experts, cfg.replay_margin))
