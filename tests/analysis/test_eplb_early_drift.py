"""early_drift.py and drift_call.py: a re-plan on three windows calls drift where the newest window moved far beyond
its tokens' own sampling noise, never on an unchanged router, and the planner then re-plans past its churn budget."""

from __future__ import annotations

import numpy as np
import pytest

from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, PlannerConfig, churn, plan
from r3trace.eplb.drift_call import drift_call
from r3trace.eplb.early_drift import change_ratio, early_ratio, half_noise
from r3trace.eplb.forecast import backtest_errors
from r3trace.eplb.plan_forecast import forecasts_from_mix
from r3trace.eplb.planner import planning_forecast
from r3trace.eplb.score import heat_of

DEFAULT = PlannerConfig()


def _early(h: np.ndarray, tokens: np.ndarray | None, demixed: np.ndarray | None,
           cfg: PlannerConfig = DEFAULT) -> bool:
    """Whether a re-plan on loads h [W, L, E] calls drift by the early test (drift_call.DriftCall.early)."""
    return drift_call(h, True, cfg, tokens, demixed).early


def _note(h: np.ndarray, cfg: PlannerConfig, tokens: np.ndarray | None, demixed: np.ndarray | None) -> str:
    return drift_call(h, True, cfg, tokens, demixed).note()


def _windows(drift: str, windows: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """The independent router (no domain mix: its raw windows are what the test reads), 2 layers, 4,096 tokens a
    window -> (loads [W, L, E], routes [W, T, L, K]); its loads are its own de-mixed windows (one kind of token)."""
    spec = TraceSpec(family="independent", drift=drift, zipf_s=0.6, num_layers=2, windows=windows, window_tokens=4096)
    routes = load_windows(spec)[0]
    return np.stack([heat_of(w, 256) for w in routes]), routes


def test_half_noise_is_the_halves_squared_difference_over_four():
    rng = np.random.default_rng(3)
    tok = rng.integers(0, 8, size=(64, 2, 2))
    assert half_noise(np.concatenate([tok[:32], tok[:32]]), 8, 2) == 0.0  # two equal blocks
    assert half_noise(np.repeat(tok[:32], 2, axis=0), 8, None) == 0.0  # alternate tokens equal
    a, b = tok[0::2], tok[1::2]
    ra = np.stack([np.bincount(a[:, i].ravel(), minlength=8) / a[:, i].size for i in range(2)])
    rb = np.stack([np.bincount(b[:, i].ravel(), minlength=8) / b[:, i].size for i in range(2)])
    assert half_noise(tok, 8, None) == pytest.approx(((ra - rb) ** 2).sum() / 4, rel=1e-12)
    blocks = np.concatenate([tok[0:16], tok[32:48]]), np.concatenate([tok[16:32], tok[48:64]])
    rc = [np.stack([np.bincount(h[:, i].ravel(), minlength=8) / h[:, i].size for i in range(2)]) for h in blocks]
    assert half_noise(tok, 8, 4) == pytest.approx(((rc[0] - rc[1]) ** 2).sum() / 4, rel=1e-12)


def test_change_ratio_is_the_plain_means_error_over_its_noise():
    # rates 0.25 / 0.75, 0.75 / 0.25, 0.5 / 0.5: the mean of the first two forecasts the third exactly
    assert change_ratio(np.array([[[1.0, 3.0]], [[3.0, 1.0]], [[1.0, 1.0]]]), 0.1) == 0.0
    moved = np.array([[[1.0, 1.0]], [[1.0, 1.0]], [[1.0, 3.0]]])  # 0.5 -> 0.25 on both experts
    assert change_ratio(moved, 0.125) == pytest.approx(2 * 0.0625 / (1.5 * 0.125))
    assert change_ratio(moved[1:], 0.125) == pytest.approx(2 * 0.0625 / (2 * 0.125))  # one window averaged


@pytest.mark.parametrize("drift, called", [("none", False), ("slow", False), ("fast", True)])
def test_three_windows_call_drift_only_where_the_router_moves(drift, called):
    h, routes = _windows(drift)
    assert _early(h, routes[-1], h) is called
    # a sample of the newest window's tokens (`r3trace eplb --replay-tokens`) scales its noise to the whole window
    assert _early(h, routes[-1][-1024:], h) is called


def test_only_three_windows_with_tokens_and_a_threshold():
    h, routes = _windows("fast", windows=4)
    assert _early(h[:3], routes[2], h[:3])
    assert not _early(h, routes[3], h)  # four windows: the backtest's own test (forecast.drifts)
    assert not _early(h[:3], None, h[:3])  # no tokens, no noise
    assert not _early(h[:3], routes[2], None)  # no token-mix fit: a drawn mix would count as drift
    assert not _early(h[:3], routes[2], h[:3], PlannerConfig(early_drift=0.0))  # off
    still = np.repeat(h[:1], 3, axis=0)  # de-mixed windows that did not move: they decide, not the raw ones
    assert not _early(h[:3], routes[2], still)
    fresh = drift_call(h[:3], False, PlannerConfig(), routes[2], h[:3])  # a fresh plan has no budget to lift
    assert (fresh.moving, fresh.err, fresh.ratio) == (False, None, None)
    assert not drift_call(h[:3], True, PlannerConfig(ema_alpha=0.5), routes[2], h[:3]).moving  # a fixed weight


@pytest.mark.parametrize("drift", ["none", "fast"])
def test_the_planner_re_plans_past_its_budget_only_where_drift_is_called(drift):
    h, routes = _windows(drift)
    cl = Cluster(32, 4, 288)
    first = plan(h[:2], cl, tokens=routes[1])
    w, moving = planning_forecast(h, first, PlannerConfig(), cl, tokens=routes[2], demixed=h)
    assert moving is (drift == "fast")
    if moving:  # planned on the newest window
        np.testing.assert_allclose(w.sum(1), h[2].sum(1))
        assert np.array_equal(np.argsort(-w, axis=1, kind="stable"), np.argsort(-h[2], axis=1, kind="stable"))
    _, off = planning_forecast(h, first, PlannerConfig(early_drift=0.0), cl, tokens=routes[2], demixed=h)
    assert not off
    assert not planning_forecast(h, first, PlannerConfig(), cl, tokens=routes[2])[1]  # no fit handed: no call
    moved = churn(first, plan(h, cl, first, tokens=routes[2], demixed=h))
    budget = PlannerConfig().seeded_churn_budget
    assert (moved > budget) is (drift == "fast"), moved


def test_the_drift_call_in_words():
    h, routes = _windows("fast", windows=5)
    cfg = PlannerConfig()
    r = early_ratio(h[:3], routes[2], h[:3])
    assert r is not None and r > cfg.early_drift
    assert _note(h[:3], cfg, routes[2], h[:3]) == (
        f"drifting: one scored window, the newest moved {r:.1f}x its tokens' sampling noise (> 8); planned on the "
        f"newest window, layers a fresh plan lowers may move, past the churn budget")
    err = backtest_errors(h)
    assert _note(h, cfg, routes[4], h).startswith(
        f"drifting: over 3 scored windows the plain mean erred {err[0] / err.min():.2f}x the best EMA weight (> 1.10)")
    still, quiet = _windows("none")
    q = early_ratio(still, quiet[2], still)
    assert q is not None and q <= cfg.early_drift
    assert _note(still, cfg, quiet[2], still) == (
        f"still: the newest window moved {q:.1f}x its tokens' sampling noise (<= 8); within the churn budget (9.5% of "
        f"slots in the multi-node layout)")
    assert _note(h[:2], cfg, routes[1], h[:2]).startswith("still: fewer than 3 windows to backtest")
    assert _note(h[:3], cfg, None, None).startswith("still: one scored window, without routes")
    err4 = backtest_errors(h[:4])
    assert err4 is not None
    ratio = f"over 2 scored windows the plain mean erred {err4[0] / err4.min():.2f}x the best EMA weight"
    want = f"drifting: {ratio}" if err4[0] > err4.min() * 1.1 else f"still: {ratio} (<= 1.10)"
    assert _note(h[:4], cfg, routes[3], h[:4]).startswith(want)


def test_groups_kept_take_the_early_call_but_forecast_from_the_raw_windows():
    """PlannerConfig.keep_groups (`r3trace eplb --keep-groups`): the de-mixed windows serve the early drift test (a
    re-plan on three windows of a fast-drifting router moves past its churn budget, as ours' default does) but never
    the forecast (plan_forecast.forecasts_from_mix), which ours' default takes from them where the history drifts."""
    keep = PlannerConfig(keep_groups=True)
    h, routes = _windows("fast", windows=6)
    other = np.ascontiguousarray(h[:, :, ::-1])  # de-mixed windows unlike the raw ones: the expert order reversed
    assert forecasts_from_mix(h, other, DEFAULT) and not forecasts_from_mix(h, other, keep)
    cl = Cluster(32, 4, 288)
    first = plan(h[:2], cl, tokens=routes[1], cfg=keep)
    assert drift_call(h[:3], True, keep, routes[2], h[:3]).early
    assert churn(first, plan(h[:3], cl, first, tokens=routes[2], cfg=keep, demixed=h[:3])) > keep.seeded_churn_budget
    assert churn(first, plan(h[:3], cl, first, tokens=routes[2], cfg=keep)) <= keep.seeded_churn_budget
    raw = plan(h, cl, first, tokens=routes[5], cfg=keep, demixed=h).phy2log
    assert np.array_equal(plan(h, cl, first, tokens=routes[5], cfg=keep, mixed=other, demixed=h).phy2log, raw)
    ours = plan(h, cl, first, tokens=routes[5], demixed=h).phy2log
    assert not np.array_equal(plan(h, cl, first, tokens=routes[5], mixed=other, demixed=h).phy2log, ours)
