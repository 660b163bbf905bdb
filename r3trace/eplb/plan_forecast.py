"""The forecast a plan plans on (planner.py's step 1), and whether the workload drifts (its step 5): an EMA of the
windows seen, its weight picked by backtest; the windows at the long-run mix of their kinds of token where the history
drifts (token_mix.py); the newest window where a re-plan on three windows calls drift from its routes' noise
(early_drift.py).

Shape legend: W windows, L layers, E experts, T tokens, K top-k.
"""

from __future__ import annotations

import numpy as np

from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.drift_call import DriftCall, drift_call
from r3trace.eplb.forecast import backtest_errors, drifts, forecast, pick_alpha
from r3trace.eplb.partners import partner_forecast
from r3trace.eplb.placement import Cluster, Placement


def forecasts_from_mix(loads: np.ndarray, mixed: np.ndarray | None, cfg: PlannerConfig,
                       err: np.ndarray | None = None) -> bool:
    """Whether planning_forecast forecasts from the de-mixed windows `mixed`: given, no fixed EMA weight, groups not
    kept, and the raw history [W, L, E] drifts (forecast.drifts on its backtest_errors, `err` where already computed).

    With groups kept (PlannerConfig.keep_groups) the de-mixed windows serve the early drift test alone. Against
    DeepSeek's hierarchical policy (bench/eplb_keep_groups.py's 78 cells of trace seed 0), forecasting from them as
    well led by +0.0011 a cell more on average but left the sample model's traces 8 / 2 / 40 and 16 / 2 / 64 0.016 and
    0.012 below hierarchical (the early test alone: +0.009 and level), and moved its router on a serving stream by
    -0.0001 .. -0.018 in 11 of its 12 fast-drift cells (seeds 0-2; one +0.015), where the early test never fires."""
    return (mixed is not None and cfg.ema_alpha is None and not cfg.keep_groups
            and drifts(loads, backtest_errors(loads) if err is None else err, cfg.refresh_drift))


def planning_forecast(loads: np.ndarray, prev: Placement | None, cfg: PlannerConfig, cluster: Cluster,
                      mixed: np.ndarray | None = None, tokens: np.ndarray | None = None,
                      demixed: np.ndarray | None = None, call: DriftCall | None = None) -> tuple[np.ndarray, bool]:
    """loads [W, L, E] or [L, E] -> (the forecast [L, E] plan() plans on, whether drift is called and acted on): a
    re-plan picks the EMA weight by backtest (step 1), a fresh plan takes choose_alpha's; without spare slots the
    floor-bound layers' light experts take the weight that picked the hot GPUs' partners best (partners.py). A
    re-plan on three windows may call drift from the newest tokens' noise instead (tokens [T, L, K],
    demixed: plan()'s), and then plans on the newest window; a held call (two nodes without routes) plans as a still
    re-plan (drift_call.py). call: drift_call's for these arguments, where the caller made it."""
    call = drift_call(loads, prev is not None, cfg, tokens, demixed, cluster) if call is None else call
    err, moving = call.err, call.moving
    if call.early:
        # one scored window picks no EMA weight (the backtest's weight on it lost the first held-out window there:
        # grouped s = 1.2 fast, 32 / 4 / 288, 0.712 against the newest window's 0.749); the test says the newest window
        # moved far beyond its noise, so the windows before it are stale
        w = forecast(loads, 1.0)
    elif mixed is not None and forecasts_from_mix(loads, mixed, cfg, err):
        # where the history drifts (a fresh plan tests it too), the forecast is the de-mixed windows' EMA, its weight
        # the one that forecast the raw windows best: a short memory follows the router but keeps the newest windows'
        # mix. Only then: the drift test stays on the raw windows (on the de-mixed ones a slow drift, sigma 0.05, is
        # no longer hidden under the mix: the 10% margin called it in 13 of 17 re-plans of bench/eplb_matrix.py's
        # grouped s = 1.2 slow 32 / 4 / 288, whose fresh re-plans moved up to 86% of slots and lost 0.04), and a still
        # re-plan on the de-mixed windows' long-memory EMA lost 0.002-0.015 there to the same on the raw ones (which
        # averages the mixes out itself) though it erred 3-40% less one window ahead
        mixed_err = backtest_errors(mixed, loads)
        assert mixed_err is not None  # drift needs >= 4 windows (forecast.MIN_DRIFT_FOLDS)
        w = forecast(mixed, pick_alpha(mixed_err))
    else:
        w = forecast(loads, cfg.ema_alpha if err is None else pick_alpha(err, 0.0 if moving else cfg.alpha_tie))
    if cfg.partner_backtest and cfg.ema_alpha is None:
        w = partner_forecast(loads, w, cluster, cfg.refresh_floor)
    return w, moving
