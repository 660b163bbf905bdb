"""The planner's forecast of the next window's loads: an EMA over the windows seen, its weight picked by backtest,
and whether that backtest says the workload moves (planner.plan then may re-place more than its churn budget).

Shape legend: W windows, L layers, E experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from r3trace.eplb import portable

ALPHAS = (0.0, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0)  # weights the backtest tries (1: the newest window, 0: plain mean)
DEFAULT_ALPHA = 0.35  # with fewer than 3 windows there is nothing to backtest on
# one backtest window is too noisy to call drift: a stationary synthetic trace (tests/analysis/test_eplb.py's
# _skewed_windows, 4,096 tokens a window) gave ratio 1.15 on one, 1.02 on two
MIN_DRIFT_FOLDS = 2


def backtest_errors(history: np.ndarray, targets: np.ndarray | None = None) -> np.ndarray | None:
    """[W, L, E] loads -> [len(ALPHAS)] squared error in rates of each EMA weight's one-window-ahead forecasts of
    windows 2 .. W - 1 (each from the windows before it), summed over layers and windows; None with < 3 windows.
    targets [W, L, E]: the windows scored, when not the history itself (the raw windows behind a de-mixed history,
    token_mix.py)."""
    per = window_errors(history, targets)
    return None if per is None else summed(per)


def window_errors(history: np.ndarray, targets: np.ndarray | None = None) -> np.ndarray | None:
    """backtest_errors before the sum over windows: [W - 2, len(ALPHAS)], one row a scored window (None with < 3)."""
    h = np.asarray(history, dtype=np.float64)
    if h.ndim == 2 or len(h) < 3:
        return None
    rates = rates_of(h)  # [W, L, E]
    return ema_window_errors([rates[:t] for t in range(2, len(rates))], rates if targets is None else rates_of(targets))


def ema_errors(seen: Sequence[np.ndarray], targets: np.ndarray) -> np.ndarray:
    """seen[k]: the rates [t, L, E] a forecaster has before window t = k + 2; targets: rates [W, L, E] -> [len(ALPHAS)]
    squared error of each EMA weight's forecast of targets[t], summed over layers and windows in order."""
    return summed(ema_window_errors(seen, targets))


def ema_window_errors(seen: Sequence[np.ndarray], targets: np.ndarray) -> np.ndarray:
    """ema_errors per scored window: [len(seen), len(ALPHAS)], row k the errors on targets[k + 2]."""
    return np.array([[float(((targets[t] - smooth_rates(h, a)) ** 2).sum()) for a in ALPHAS]
                     for t, h in enumerate(seen, 2)]).reshape(len(seen), len(ALPHAS))


def summed(per: np.ndarray) -> np.ndarray:
    """[F, A] per-window errors -> [A], added window by window in order (each weight's total rounds as one running
    sum from 0, the order the backtest has always summed in, so picks that tie to the last bit stay as they were)."""
    err = np.zeros(per.shape[1])
    for row in per:
        err += row
    return err


def rates_of(loads: np.ndarray) -> np.ndarray:
    """[..., E] loads -> each row's share of its total (0 where a row is empty)."""
    return loads / np.maximum(loads.sum(-1, keepdims=True), 1e-12)


def choose_alpha(history: np.ndarray) -> float:
    """[W, L, E] loads -> the EMA weight whose backtest_errors are least (DEFAULT_ALPHA with < 3 windows).

    Why by backtest: the best weight is a property of the workload (slow drift wants a long memory, fast
    drift a short one), which a user cannot be asked to know."""
    err = backtest_errors(history)
    return DEFAULT_ALPHA if err is None else pick_alpha(err)


def pick_alpha(err: np.ndarray, tie: float = 0.0) -> float:
    """backtest_errors [len(ALPHAS)] -> the smallest weight (the longest memory) whose error is within (1 + tie) of
    the least; tie = 0: the best weight."""
    return ALPHAS[int(np.flatnonzero(err <= err.min() * (1 + tie))[0])]


def drifts(history: np.ndarray, err: np.ndarray | None, threshold: float) -> bool:
    """[W, L, E] loads and their backtest_errors -> True when the workload moves: over at least MIN_DRIFT_FOLDS
    backtest windows, the plain mean's forecasts erred more than the best weight's by over `threshold`
    (PlannerConfig.refresh_drift). On windows drawn from one unchanged router the
    mean is the best forecast (ratio 1.00-1.04 over bench/eplb_traces.py's families at 4,096 tokens a window,
    skew 0.6 and 1.2); under slow drift (sigma 0.05) 1.00-1.23, under fast drift (0.3) 1.00-1.84 and above 1.1
    from its third window on."""
    folds = len(history) - 2 if np.ndim(history) == 3 else 0
    return err is not None and folds >= MIN_DRIFT_FOLDS and bool(err[0] > err.min() * (1 + threshold))


def excess_t(per: np.ndarray) -> float:
    """window_errors [F, len(ALPHAS)] (F >= 2) -> how surely the best EMA weight (by the summed errors) beats the
    plain mean: the mean's error less the best weight's, per scored window, its mean over its standard error (a paired
    t statistic over the windows; inf where every window's excess is the same and > 0).
    The ratio test (drifts) sums the windows, so one or two windows the mean forecast badly can carry it: a window
    mix drawn afresh each window (bench/eplb_traces.py's grouped router) looks like drift on a few of them, and
    under slow drift (sigma 0.05) the ratio reached 1.75 where fast drift (0.3) gave 1.1-1.8 (PlannerConfig.drift_t
    has the figures)."""
    d = per[:, 0] - per[:, int(np.argmin(summed(per)))]
    sd = float(d.std(ddof=1))
    if sd == 0:
        return float("inf") if d.mean() > 0 else 0.0
    return float(d.mean() / (sd / np.sqrt(len(d))))


def forecast(history: np.ndarray, alpha: float | None) -> np.ndarray:
    """[W, L, E] or [L, E] loads -> [L, E] EMA forecast of the next window (in the last window's scale);
    alpha None: choose_alpha's."""
    h = np.asarray(history, dtype=np.float64)
    if h.ndim == 2:
        return h
    alpha = choose_alpha(h) if alpha is None else alpha
    return smooth_rates(rates_of(h), alpha) * h[-1].sum(-1, keepdims=True)


def smooth_rates(rates: np.ndarray, alpha: float) -> np.ndarray:
    """[W, L, E] -> [L, E]: weights alpha (1 - alpha)^age on the windows (age 0 = newest), normalised over the W
    windows there are, so alpha -> 0 is the plain mean and 1 the newest window.

    Normalised because the textbook EMA started from the oldest window gives it the rest, (1 - alpha)^(W - 1):
    0.81 of a 3-window forecast at alpha = 0.1. Planned on that, held-out balancedness under slow drift lost
    0.01-0.02 to the plain mean (bench/eplb_matrix.py cells 64/8/320 and 16/2/288), and the backtest, which
    scored every weight that way, never picked the mean."""
    if alpha == 0:
        return rates.mean(0)
    wt = [alpha * (1 - alpha) ** age for age in range(len(rates) - 1, -1, -1)]  # oldest first
    total = portable.left_sum(wt)  # not sum(): CPython 3.12's rounds another way (portable.left_sum)
    # window by window, not np.tensordot: BLAS (OpenBLAS's kernel is picked per CPU at run time) rounds the sum in
    # another order on another machine, and the planner's swaps and contests break near-ties by those last bits: the
    # same code and numpy build moved ours in 74 of bench/eplb_matrix.py's 124 cells (-0.004 .. +0.005) between an
    # AVX-512 and an AVX2 kernel; summed here every machine gets the same forecast (tests/analysis/test_eplb_blas.py)
    out = (wt[0] / total) * rates[0]
    for k in range(1, len(rates)):
        out += (wt[k] / total) * rates[k]
    return out
