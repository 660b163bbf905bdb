"""The backtest's drift call needs its per-window excess to be significant (forecast.excess_t,
PlannerConfig.drift_t, drift_call.DriftCall.called): the grouped router draws each window's mix of domains afresh, so
on a few windows the plain mean can err far more than a short memory by chance; a router that drifts fast makes the
mean err more on nearly every window."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, PlannerConfig, churn, plan
from r3trace.eplb.drift_call import drift_call
from r3trace.eplb.forecast import ALPHAS, backtest_errors, drifts, excess_t, window_errors
from r3trace.eplb.score import heat_of

HISTORY = 8  # windows a re-plan sees, as bench/eplb_matrix.py's


def _heats(drift: str, seed: int, windows: int = 12) -> np.ndarray:
    routes, _ = load_windows(TraceSpec(family="grouped", zipf_s=0.6, drift=drift, num_layers=6, windows=windows,
                                       window_tokens=4096, seed=seed))  # type: ignore[arg-type]
    return np.stack([heat_of(r, 256) for r in routes])  # [W, L, E]


def test_excess_t_is_the_paired_t_of_the_mean_against_the_best_weight() -> None:
    rng = np.random.default_rng(5)
    h = rng.gamma(2.0, 10.0, (7, 3, 11))  # [W, L, E]
    err = backtest_errors(h)
    assert err is not None
    best = ALPHAS[int(err.argmin())]
    r = h / h.sum(-1, keepdims=True)
    d = []
    for t in range(2, 7):  # the scored windows, each forecast from those before it
        mean = r[:t].mean(0)
        wt = np.array([best * (1 - best) ** a for a in range(t - 1, -1, -1)])
        ema = np.einsum("w,wle->le", wt / wt.sum(), r[:t]) if best > 0 else mean
        d.append(((r[t] - mean) ** 2).sum() - ((r[t] - ema) ** 2).sum())
    d = np.asarray(d)
    want = d.mean() / (d.std(ddof=1) / np.sqrt(len(d)))
    per = window_errors(h)
    assert per is not None and per.shape == (5, len(ALPHAS))
    assert abs(excess_t(per) - want) <= 1e-9 * max(1.0, abs(want))
    np.testing.assert_allclose(err[int(err.argmin())] + d.sum(), err[0], rtol=1e-12)  # the same windows as the ratio
    running = [0.0] * len(ALPHAS)  # the backtest's sum: each weight's windows added in order, from 0
    for row in per:
        running = [r + float(v) for r, v in zip(running, row, strict=True)]
    np.testing.assert_array_equal(err, running)  # to the last bit: near-tied weights are picked as before
    assert excess_t(np.ones((5, len(ALPHAS)))) == 0.0  # no excess at all: never significant


def test_a_mix_that_looks_like_drift_on_a_few_windows_is_not_called() -> None:
    """Slow drift (sigma 0.05), trace seed 1: on histories of up to 8 windows the ratio test calls drift in 8 of 9
    re-plans (the plain mean erred up to 1.49x the best weight), each by t = 0.5-1.85; fast drift (0.3) on the same
    seed is called by t = 2.2-3.9 from four scored windows on (12 and 17 on two and three)."""
    slow, fast = _heats("slow", 1), _heats("fast", 1)
    cfg = PlannerConfig()
    ratio_calls, t_slow, t_fast = 0, [], []
    for hi in range(4, 13):
        h = slow[max(0, hi - HISTORY):hi]
        err = backtest_errors(h)
        assert err is not None
        if drifts(h, err, cfg.refresh_drift):
            ratio_calls += 1
            t_slow.append(excess_t(window_errors(h)))
        hf = fast[max(0, hi - HISTORY):hi]
        call = drift_call(hf, True, cfg)
        if len(hf) >= 6:  # four scored windows
            assert call.backtest and call.called and call.moving
            assert call.t is not None
            t_fast.append(call.t)
    assert ratio_calls >= 5 and max(t_slow) < cfg.drift_t <= min(t_fast)
    call = drift_call(slow[4:12], True, cfg)
    assert call.backtest and not call.called and not call.moving
    assert call.note().startswith("still: over 6 scored windows the plain mean erred")
    assert "standard errors of its excess a window (< 2)" in call.note()
    assert drift_call(slow[4:12], True, replace(cfg, drift_t=0.0)).moving  # the ratio alone calls it
    early = drift_call(slow[:5], True, cfg)  # three scored windows (< MIN_T_FOLDS): the ratio alone
    assert early.backtest and early.t is None and early.moving


def test_a_still_call_keeps_a_four_node_re_plan_within_its_churn_budget() -> None:
    """Heat only (an SGLang dump), slow drift, seed 1, 32 GPUs / 4 nodes / 288 slots: where the ratio test alone would
    call drift the re-plan moves past its budget; with the t test it is a still one (<= seeded_churn_budget)."""
    cl, cfg = Cluster(32, 4, 288), PlannerConfig()
    h = _heats("slow", 1, 9)
    prev = plan(h[:4], cl)
    assert drift_call(h[1:9], True, cfg).backtest
    still, ratio = plan(h[1:9], cl, prev), plan(h[1:9], cl, prev, cfg=replace(cfg, drift_t=0.0))
    assert churn(prev, still) <= cfg.seeded_churn_budget + 1e-9 < churn(prev, ratio)
