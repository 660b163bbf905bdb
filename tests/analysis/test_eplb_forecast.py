"""The planner's forecast: EMA weights normalised over the windows there are (forecast.smooth_rates)."""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb.forecast import choose_alpha, forecast, pick_alpha


def test_weights_are_normalised_over_the_windows() -> None:
    # 3 windows of one layer, 2 experts: weights 0.5 x 0.5^age = 0.125, 0.25, 0.5 (oldest first), sum 0.875
    h = np.array([[[1.0, 3.0]], [[2.0, 2.0]], [[3.0, 1.0]]])  # [W, L, E], 4 tokens a window
    rates = h / 4
    want = (0.125 * rates[0] + 0.25 * rates[1] + 0.5 * rates[2]) / 0.875 * 4
    np.testing.assert_allclose(forecast(h, 0.5), want, rtol=1e-12)
    np.testing.assert_allclose(forecast(h, 0.0), rates.mean(0) * 4, rtol=1e-12)  # alpha 0: the plain mean
    np.testing.assert_allclose(forecast(h, 1.0), h[-1], rtol=1e-12)  # alpha 1: the newest window
    # a small weight is close to the mean, not to the oldest window (the unnormalised EMA gave it 0.81 here)
    assert forecast(h, 0.1)[0, 0] == pytest.approx(0.14025 / 0.271 * 4, rel=1e-12)  # mean 2.0, unnormalised 1.29


def test_backtest_picks_the_mean_for_a_stationary_workload_and_the_newest_for_a_random_walk() -> None:
    rng = np.random.default_rng(4)
    p = rng.dirichlet(np.ones(64), size=2)  # [L, E] one fixed popularity per layer
    still = np.stack([rng.multinomial(4000, q) for _ in range(8) for q in p]).reshape(8, 2, 64).astype(float)
    assert choose_alpha(still) <= 0.1  # 0 or 0.1 by the sampling noise of 4,000 tokens a window
    logit = np.cumsum(rng.normal(0, 1.0, (8, 2, 64)), 0)  # fast drift, 40k tokens a window: little noise
    q = np.exp(logit) / np.exp(logit).sum(-1, keepdims=True)
    walk = np.stack([[rng.multinomial(40000, q[w, layer]) for layer in range(2)] for w in range(8)]).astype(float)
    assert choose_alpha(walk) >= 0.5


def test_pick_alpha_takes_the_longest_memory_within_the_tie() -> None:
    """ALPHAS = 0, 0.1, 0.2, 0.35, 0.5, 0.7, 1: errors least at 0.35 (100); 0.2 is within 2% (101.5), 0.1 just
    outside (102.5): tie 0 gives the best weight, 0.02 gives 0.2, 0.03 gives 0.1 and 0.05 the plain mean."""
    err = np.array([104.0, 102.5, 101.5, 100.0, 100.5, 110.0, 130.0])
    assert pick_alpha(err) == 0.35
    assert pick_alpha(err, 0.02) == 0.2
    assert pick_alpha(err, 0.03) == 0.1
    assert pick_alpha(err, 0.05) == 0.0

