"""The hot GPUs' light partners (partners.py): without spare slots, a floor-bound layer's light experts take the EMA
weight that picked the lightest ones best in backtest. Run: .venv/bin/pytest tests/analysis/test_eplb_partners.py -q"""

from __future__ import annotations

import numpy as np

from r3trace.eplb import Cluster, PlannerConfig, plan
from r3trace.eplb.forecast import ALPHAS, choose_alpha, forecast, smooth_rates
from r3trace.eplb.partners import partner_errors, partner_forecast

E, W, HOT = 64, 7, 6  # experts, history windows, floor-bound layers
CL = Cluster(16, 2, 64, num_groups=8)  # every slot one expert, 4 a GPU
TOKENS = 3000  # expert choices a window and layer


def workload(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (loads [W + 1, HOT + 1, E], true rates alike). Layers 0 .. HOT - 1: four hot experts whose rates walk (the
    newest window forecasts them best) and 60 light ones at fixed rates that only sampling noise moves (a long memory
    ranks them best); the last layer flat, no expert near the max-load floor."""
    rng = np.random.default_rng(seed)
    rates = np.full((W + 1, HOT + 1, E), 1.0 / E)
    for layer in range(HOT):
        light, hot = rng.uniform(0.3, 1.0, E - 4), np.array([12.0, 9.0, 7.0, 6.0])
        for t in range(W + 1):
            hot = hot * np.exp(rng.normal(0.0, 0.5, 4))  # persistent steps
            rates[t, layer] = np.concatenate([hot, light]) / (hot.sum() + light.sum())
    loads = np.stack([[rng.multinomial(TOKENS, r) for r in rt] for rt in rates]).astype(np.float64)
    return loads, rates


def test_partner_errors_score_each_weights_lightest_experts_in_the_next_window() -> None:
    rng = np.random.default_rng(3)
    rates = rng.dirichlet(np.ones(10), (4, 2))  # [W, B, E]
    n = np.array([3, 1])
    want = np.zeros(len(ALPHAS))
    for i, a in enumerate(ALPHAS):
        for t in (2, 3):
            f = smooth_rates(rates[:t], a)
            for b in range(2):
                want[i] += rates[t, b, np.argsort(f[b], kind="stable")[: n[b]]].sum()
    np.testing.assert_allclose(partner_errors(rates, n), want, rtol=1e-12)


def test_floor_bound_light_experts_take_the_weight_that_picks_partners_best() -> None:
    for seed in range(4):
        loads, rates = workload(seed)
        h = loads[:W]
        w = forecast(h, None)
        out = partner_forecast(h, w, CL, 0.25)
        mean = w.sum(1, keepdims=True) / CL.num_gpus
        assert (w[:HOT].max(1) > 1.25 * mean[:HOT, 0]).all() and w[HOT].max() < 1.25 * mean[HOT, 0]
        np.testing.assert_array_equal(out[HOT], w[HOT])  # not floor-bound: unchanged
        hot = w > mean
        np.testing.assert_array_equal(out[hot], w[hot])  # the hot experts keep the forecast
        r = h / h.sum(-1, keepdims=True)
        n = hot[:HOT].sum(1) * (CL.slots_per_gpu - 1)
        picked = ALPHAS[int(partner_errors(r[:, :HOT], n).argmin())]
        light = ~hot
        light[HOT] = False
        np.testing.assert_allclose(out[light], (smooth_rates(r, picked) * h[-1].sum(-1, keepdims=True))[light])
        assert picked < choose_alpha(h) == 1.0  # the hot experts' walk pulls the all-expert weight to the newest
        # what each layer's n lightest by either estimate truly weigh next window, summed over the layers
        by_out, by_w = (sum(rates[W, i, np.argsort(f[i], kind="stable")[: n[i]]].sum() for i in range(HOT))
                        for f in (out, w))
        assert by_out < by_w - 0.002


def test_plans_give_the_hot_gpus_lighter_partners() -> None:
    for seed in range(2):
        loads, rates = workload(seed)
        on, off = (plan(loads[:W], CL, cfg=PlannerConfig(partner_backtest=b)) for b in (True, False))
        sums = []
        for pl in (on, off):
            gpus = pl.phy2log[:HOT].reshape(HOT, CL.num_gpus, -1)  # [HOT, G, S]
            top = np.isin(gpus, [0, 1, 2, 3]).any(2, keepdims=True)  # [HOT, G, 1] the hot experts' GPUs
            true = np.take_along_axis(rates[W, :HOT], gpus.reshape(HOT, -1), 1).reshape(gpus.shape)
            sums.append(float((true * top).sum()))  # their true load next window, over the layers
        assert sums[0] < sums[1] - 0.002
