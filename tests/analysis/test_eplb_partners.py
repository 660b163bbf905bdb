"""The hot GPUs' light partners (partners.py): without spare slots, a floor-bound layer's light experts take the EMA
weight that picked the lightest ones best in backtest. Run: .venv/bin/pytest tests/analysis/test_eplb_partners.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster, PlannerConfig, plan
from r3trace.eplb.forecast import ALPHAS, choose_alpha, forecast, smooth_rates
from r3trace.eplb.partners import cold_forecast, coldest_partners, partner_errors, partner_forecast
from r3trace.eplb.placement import PlacementError

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


def test_coldest_partners_by_hand() -> None:
    # 4 GPUs of 2 slots, one expert a slot. Mean GPU load 25: experts 0 (40) and 1 (30) are hot, 2 (24) is not, so
    # with hot = 3 only two move: 0 takes the coldest (7: load 1), 1 the next (6: load 2). GPU 0 held [0, 5], GPU 1
    # [1, 2], GPU 2 [3, 6], GPU 3 [4, 7]: 7 swaps with 5 (slots 1 and 7), then 6 with 2 (slots 3 and 5)
    cl = Cluster(4, 1, 8)
    w = np.array([[40.0, 30.0, 24.0, 3.0, 4.0, 3.0, 2.0, 1.0]])
    ph = np.array([[0, 5, 1, 2, 3, 6, 4, 7]])
    assert coldest_partners(ph, w, cl, 3).tolist() == [[0, 7, 1, 6, 3, 2, 4, 5]]
    assert coldest_partners(ph, w, cl, 1).tolist() == [[0, 7, 1, 2, 3, 6, 4, 5]]
    np.testing.assert_array_equal(coldest_partners(ph, w, cl, 0), ph)  # off
    done = coldest_partners(ph, w, cl, 3)
    np.testing.assert_array_equal(coldest_partners(done, w, cl, 3), done)  # already paired: no slot moves
    # a hot expert's partner that is hot itself moves off its GPU: 0 and 1 shared GPU 0, so 1 goes to 7's slot (GPU
    # 3), where 6 then replaces its partner 4
    both = np.array([[0, 1, 5, 2, 3, 6, 4, 7]])
    assert coldest_partners(both, w, cl, 3).tolist() == [[0, 7, 5, 2, 3, 4, 6, 1]]


def test_coldest_partners_on_random_layouts() -> None:
    """Each of the hot hottest experts above the mean GPU load shares its GPU with its rank among the coldest of the
    others; every other expert keeps its slot unless it was moved to make room (at most 2 slots a hot expert)."""
    rng = np.random.default_rng(5)
    for _ in range(30):
        g = int(rng.integers(2, 20))
        cl = Cluster(2 * g, 1 if g % 2 else 2, 4 * g)
        e, hot = 4 * g, int(rng.integers(1, 6))
        w = rng.pareto(1.2, (3, e)) * 10 + rng.integers(0, 3, (3, e))  # heavy tails and ties
        ph = np.stack([rng.permutation(e) for _ in range(3)])
        out = coldest_partners(ph, w, cl, hot)
        for layer in range(3):
            assert sorted(out[layer].tolist()) == list(range(e))
            mean = w[layer].sum() / cl.num_gpus
            hots = [x for x in np.argsort(-w[layer], kind="stable")[:hot] if w[layer, x] > mean]
            cold = [x for x in np.argsort(w[layer], kind="stable") if x not in hots][: len(hots)]
            pairs = out[layer].reshape(-1, 2)
            for x, c in zip(hots, cold, strict=True):
                gpu = pairs[(pairs == x).any(1)][0]
                assert set(gpu.tolist()) == {x, c}
            assert (out[layer] != ph[layer]).sum() <= 2 * len(hots)


def test_coldest_partners_leave_other_shapes_and_plans_take_them() -> None:
    rng = np.random.default_rng(6)
    w = rng.pareto(1.0, (2, 24)) * 10 + 1
    ph = np.stack([rng.permutation(24) for _ in range(2)])
    np.testing.assert_array_equal(coldest_partners(ph, w, Cluster(8, 2, 24), 3), ph)  # 3 slots a GPU
    spare = np.concatenate([ph, ph[:, :4]], 1)  # 2 slots a GPU, 4 spare ones
    np.testing.assert_array_equal(coldest_partners(spare, w, Cluster(14, 2, 28), 3), spare)
    # the planner: 16 GPUs / 2 nodes / 32 slots, every slot one expert; its plans pair the forecast's hottest experts
    # above the mean GPU load with the coldest (a flat history: the forecast is the mean window)
    cl = Cluster(16, 2, 32, num_groups=8)
    loads = np.stack([rng.pareto(1.0, (2, 32)) * 10 + 1] * 3)
    for prev in (None, plan(loads, cl)):
        got = plan(loads, cl, prev).phy2log
        assert got.tolist() == coldest_partners(got, loads[0], cl, 3).tolist()
        mean = loads[0].sum(1) / 16
        pairs = got.reshape(2, -1, 2)
        for layer in range(2):
            x, c = int(np.argmax(loads[0, layer])), int(np.argmin(loads[0, layer]))
            assert loads[0, layer, x] > mean[layer] and {x, c} in [set(p.tolist()) for p in pairs[layer]]
    off = plan(loads, cl, cfg=PlannerConfig(hot_partners=0)).phy2log
    assert (off != plan(loads, cl).phy2log).any()  # the rule moved something here
    with pytest.raises(PlacementError, match="hot_partners=-1 must be >= 0"):
        PlannerConfig(hot_partners=-1)


def test_cold_forecast_takes_the_weight_that_finds_the_lightest() -> None:
    """partners.cold_forecast: the EMA weight whose backtest picked the `light` lightest experts best, over the layers
    with an expert above the mean GPU load (two slots a GPU: 32 GPUs, 64 slots). The hot experts' walk pulls the
    all-expert weight to the newest window; the light experts' fixed rates want a long memory."""
    cl = Cluster(32, 2, 64, num_groups=8)
    for seed in range(3):
        loads, rates = workload(seed)
        h = loads[:W]
        w = forecast(h, None)
        got = cold_forecast(h, w, cl, 16)
        r = h / h.sum(-1, keepdims=True)
        rows = (w > w.sum(1, keepdims=True) / cl.num_gpus).any(1)
        assert rows[:HOT].all() and not rows[HOT]  # the flat layer has no hot expert: not backtested
        picked = ALPHAS[int(partner_errors(r[:, rows], np.full(int(rows.sum()), 16)).argmin())]
        np.testing.assert_allclose(got, forecast(h, picked), rtol=1e-12)
        assert picked < choose_alpha(h) == 1.0
        # the 3 lightest of each hot layer by either estimate: what they truly weigh next window
        by_got, by_w = (sum(rates[W, i, np.argsort(f[i], kind="stable")[:3]].sum() for i in range(HOT))
                        for f in (got, w))
        assert by_got < by_w
    np.testing.assert_array_equal(cold_forecast(h[:2], w, cl, 16), w)  # < 3 windows: nothing to backtest
    np.testing.assert_array_equal(cold_forecast(h, w, cl, 0), w)  # off
    flat = np.ones((4, 2, 64))
    np.testing.assert_array_equal(cold_forecast(flat, flat[-1], cl, 16), flat[-1])  # no hot expert
