"""The windows' spread (scenarios.py) and the leveling's variance term: experts that rise and fall together are parted.
Run: .venv/bin/pytest tests/analysis/test_eplb_spread.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster, PlannerConfig, churn, plan
from r3trace.eplb.forecast import forecast
from r3trace.eplb.leveling import level_refine
from r3trace.eplb.scenarios import deviations, spread

E = 64


def _windows(seed: int, k: int, layers: int, together: bool, tokens: int = 20_000) -> np.ndarray:
    """[K, L, E] counts of `tokens` draws a window from fixed Pareto rates; together: experts 0-15 of each layer are
    scaled by one factor, 0.6 or 1.4, drawn per window (a domain mix moving them as one)."""
    rng = np.random.default_rng(seed)
    p = rng.pareto(1.0, (layers, E)) + 0.5
    out = np.empty((k, layers, E))
    for t in range(k):
        q = p.copy()
        if together:
            q[:, :16] *= rng.choice([0.6, 1.4], (layers, 1))
        out[t] = [rng.multinomial(tokens, row / row.sum()) for row in q]
    return out


def test_deviations_are_each_windows_rates_less_their_mean_in_the_forecasts_tokens() -> None:
    h = _windows(0, 5, 2, True)
    w = forecast(h, 0.0)
    dev = deviations(h, w, 8)
    assert dev is not None and dev.shape == (5, 2, E)
    np.testing.assert_allclose(dev.sum(0), 0.0, atol=1e-9)
    rates = h / h.sum(-1, keepdims=True)
    np.testing.assert_allclose(dev[2, 1], (rates[2, 1] - rates[:, 1].mean(0)) * w[1].sum())
    last = deviations(h, w, 3)  # the newest 3 windows only
    assert last is not None
    np.testing.assert_allclose(last[0, 0], (rates[2, 0] - rates[2:, 0].mean(0)) * w[0].sum())
    assert deviations(h[:2], w, 8) is None and deviations(h, w, 2) is None and spread(h, w, 0) is None


def test_spread_keeps_the_moving_block_and_drops_noise_alone() -> None:
    h = _windows(1, 7, 3, True)
    w = forecast(h, 0.0)
    sp = spread(h, w, 8)
    assert sp is not None and sp.shape[0] >= 1
    # the block's sum: its variance over the windows is almost all on the kept axes (measured 0.97-1.00 a layer)
    block = np.zeros(E)
    block[:16] = 1.0
    dev = deviations(h, w, 8)
    assert dev is not None
    total = ((dev @ block) ** 2).mean(0)  # [L]
    kept = ((sp @ block) ** 2).sum(0)
    assert ((kept / total > 0.9) & (kept <= total * (1 + 1e-9))).all()
    # windows that differ by sampling noise alone: no axis above the noise bulk, so no spread
    noise = _windows(1, 7, 3, False)
    assert spread(noise, forecast(noise, 0.0), 8) is None


def test_the_variance_term_parts_two_experts_that_move_together() -> None:
    # 2 GPUs of 2 slots, 4 experts of equal forecast load: GPU 0 holds 0 and 1, which rise and fall together against
    # 2 and 3. On the forecast every layout is level (no swap gains); with the spread one swap parts them
    cl = Cluster(2, 1, 4, num_groups=1)
    w = np.full((1, 4), 10.0)
    ph, cnt = np.array([[0, 1, 2, 3]]), np.ones((1, 4), dtype=np.int64)
    dev = np.array([[[5.0, 5.0, -5.0, -5.0]]])  # [R, L, E]
    np.testing.assert_array_equal(level_refine(ph, w, cnt, cl, 4, 1e-4, 0.5), ph)
    out = level_refine(ph, w, cnt, cl, 4, 1e-4, 0.5, spread=dev)
    assert sorted(np.sort(out[0].reshape(2, 2) // 2, 1).tolist()) == [[0, 1], [0, 1]]  # one of 0-1, one of 2-3 each
    assert (out != ph).sum() == 2  # one swap, then nothing gains


def _expected_squares(ph: np.ndarray, w: np.ndarray, sp: np.ndarray, cl: Cluster) -> float:
    """Sum over layers and GPUs of the squared forecast load plus the spread's variance (even split)."""
    n_layers = len(ph)
    cnt = np.stack([np.bincount(row, minlength=E) for row in ph])

    def gpu(load: np.ndarray) -> np.ndarray:
        return np.take_along_axis(load / cnt, ph, 1).reshape(n_layers, cl.num_gpus, -1).sum(-1)

    return float((gpu(w) ** 2).sum() + sum((gpu(d) ** 2).sum() for d in sp))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_seeded_replan_lowers_the_expected_squares_within_its_budget(seed: int) -> None:
    cl = Cluster(16, 2, 160, num_groups=4)  # 10 slots a GPU, 96 spare slots (> 128 slots: no polish, fast)
    spread_layout = PlannerConfig(node_copies=False)  # 80 slots a node hold all 64 experts: node copies otherwise
    h = _windows(10 + seed, 6, 3, True)
    first = plan(h[:3], cl, cfg=spread_layout)
    off = plan(h, cl, first, cfg=PlannerConfig(spread_windows=0, node_copies=False))
    on = plan(h, cl, first, cfg=spread_layout)
    w = forecast(h, 0.0)  # the still workload's forecast: the longest memory (alpha_tie)
    sp = spread(h, w, 8)
    assert sp is not None
    assert _expected_squares(on.phy2log, w, sp, cl) < _expected_squares(off.phy2log, w, sp, cl)
    assert churn(first, on) <= PlannerConfig().seeded_churn_budget
    # two slots a GPU (pairing.py follows the leveling) and noise-only windows: the plan without a spread
    two = Cluster(80, 4, 160, num_groups=4)
    prev = plan(h[:3], two)
    np.testing.assert_array_equal(plan(h, two, prev).phy2log,
                                  plan(h, two, prev, cfg=PlannerConfig(spread_windows=0)).phy2log)
    noise = _windows(10 + seed, 6, 3, False)
    prev = plan(noise[:3], cl)
    np.testing.assert_array_equal(plan(noise, cl, prev).phy2log,
                                  plan(noise, cl, prev, cfg=PlannerConfig(spread_windows=0)).phy2log)
