"""A plan's drift call, made once: whether a re-plan's workload moved past its churn budget (plan_forecast's `moving`),
by which test, and the figures behind it, which `r3trace eplb --previous` prints (DriftCall.note).

Two tests, on the raw history [W, L, E]: the backtest's (forecast.drifts: over >= MIN_DRIFT_FOLDS scored windows the
plain mean erred more than refresh_drift over the best EMA weight), and on three windows, where the backtest scores
one, the newest window's move against its tokens' sampling noise (early_drift.py). A fresh plan calls neither: it
has no budget to lift.
Shape legend: W windows, L layers, E experts, T tokens, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.early_drift import EARLY_WINDOWS, early_ratio
from r3trace.eplb.forecast import backtest_errors, drifts


@dataclass(frozen=True)
class DriftCall:
    cfg: PlannerConfig
    windows: int  # W; 0 for one [L, E] window
    err: np.ndarray | None  # a re-plan's forecast.backtest_errors of the raw history (None: < 3 windows, fixed weight)
    backtest: bool  # forecast.drifts on err
    ratio: float | None  # early_drift.early_ratio where the early test applies (a re-plan, early_drift > 0)
    early: bool  # ratio > cfg.early_drift

    @property
    def moving(self) -> bool:
        """Whether the re-plan may move past its churn budget."""
        return self.backtest or self.early

    def note(self) -> str:
        """The call in words: drifting, by the backtest or by the early ratio, or still, and why."""
        cfg, err, w = self.cfg, self.err, self.windows
        budget = f"within the churn budget ({cfg.seeded_churn_budget:.1%} of slots in the multi-node layout)"
        if w == 0 or cfg.ema_alpha is not None:
            return f"still: no backtest on {'one window' if w == 0 else 'a fixed EMA weight'}; {budget}"
        if self.backtest:
            assert err is not None
            return (f"drifting: over {w - 2} scored windows the plain mean erred {err[0] / err.min():.2f}x the best "
                    f"EMA weight (> {1 + cfg.refresh_drift:.2f}); layers a fresh plan lowers may move, past the churn "
                    f"budget")
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
               demixed: np.ndarray | None = None) -> DriftCall:
    """loads [W, L, E] or [L, E]; replan: a previous placement is given; tokens [T, L, K] the newest window's, demixed
    [W, L, E] the windows at their long-run mix (token_mix.Source.demixed) -> the call (module doc). Only a re-plan with
    no fixed EMA weight is tested."""
    h = np.asarray(loads, dtype=np.float64)
    tested = replan and cfg.ema_alpha is None
    err = backtest_errors(h) if tested else None
    ratio = early_ratio(h, tokens, demixed) if tested and cfg.early_drift > 0 else None
    return DriftCall(cfg, len(h) if h.ndim == 3 else 0, err, drifts(h, err, cfg.refresh_drift), ratio,
                     ratio is not None and ratio > cfg.early_drift)
