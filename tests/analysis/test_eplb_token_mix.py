"""token_mix: the fitted kinds of token, the windows at their long-run mix, the kinds AIC picks and the source the
backtest picks, on windows drawn here from a known mixture with one pick a layer, where the model is exact: a token of
kind d in window w picks expert e of layer l with probability softmax(a[w, l] + b[d, l])[e], its kind shared by its
layers, each window's kind shares drawn Dirichlet(1).

Run: .venv/bin/pytest tests/analysis/test_eplb_token_mix.py -q
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from r3trace.cli import main
from r3trace.eplb import Cluster, PlannerConfig, plan, token_mix
from r3trace.eplb.evaluate import plan_policy
from r3trace.eplb.forecast import backtest_errors, drifts, forecast, pick_alpha
from r3trace.eplb.placement import from_json
from r3trace.eplb.planner import planning_forecast
from r3trace.trace import TraceWriter

W, L, E, T = 6, 6, 16, 3000
MIX = 2048  # r3trace eplb's --mix-tokens default
T0 = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00 in ns: a whole second, so rollup windows start on it


def draw(kinds: int, lean: float, seed: int, drift: float = 0.6, windows: int = W, layers: int = L) -> tuple[
        list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """-> (W routes [T, L, 1], each token's kind [W, T], the windows' drawn shares [W, D], the expected loads at
    equal shares [W, L, E] (T picks a layer))."""
    rng = np.random.default_rng(seed)
    a = np.cumsum(rng.normal(0, drift, (windows, layers, E)), axis=0)  # the router drifts window to window
    b = rng.normal(0, lean, (kinds, layers, E))  # each kind's lean, the same in every window
    p = np.exp(a[:, None] + b[None])  # [W, D, L, E]
    p /= p.sum(-1, keepdims=True)
    shares = rng.dirichlet(np.ones(kinds), windows)
    routes, kind = [], np.empty((windows, T), dtype=np.int64)
    for w in range(windows):
        kind[w] = rng.choice(kinds, T, p=shares[w])
        u = rng.random((T, layers, 1))
        cdf = np.cumsum(p[w, kind[w]], axis=-1)  # [T, L, E]
        routes.append((u > cdf).sum(-1).clip(max=E - 1).astype(np.int16)[..., None])  # [T, L, 1]
    return routes, kind, shares, p.mean(1) * T


def heat(routes: list[np.ndarray]) -> np.ndarray:
    return np.stack([np.stack([np.bincount(r[:, li].ravel(), minlength=E) for li in range(r.shape[1])])
                     for r in routes]).astype(np.float64)


def test_fit_finds_each_tokens_kind_and_the_windows_shares() -> None:
    routes, kind, shares, _ = draw(3, 1.5, seed=1)
    mix = token_mix.fit(routes, E, 3)
    flat = np.concatenate([np.argmax(token_mix._posterior(f, lp, s), 1) for f, lp, s in zip(
        token_mix._flat(routes, E), np.log(mix.p.reshape(W, 3, -1)), mix.shares, strict=True)])
    truth = kind.ravel()
    agree = max(float((np.asarray(perm)[flat] == truth).mean()) for perm in itertools.permutations(range(3)))
    assert agree > 0.95
    perm = max(itertools.permutations(range(3)), key=lambda q: float((np.asarray(q)[flat] == truth).mean()))
    fitted = mix.shares[:, np.argsort(perm)]  # fitted kind j is true kind perm[j]
    drawn = np.stack([np.bincount(k, minlength=3) / T for k in kind])
    assert np.abs(fitted - drawn).max() < 0.03
    assert np.abs(drawn - shares).max() < 0.05  # the draw itself: shares of 3,000 tokens


def test_many_layers_fit_the_kinds_on_a_subset_then_every_layer() -> None:
    # 20 layers, one pick each: the EM reads EM_LAYERS = 8 of them (8 picks a token), then every layer is fitted to
    # those posteriors; the windows at equal shares come out as near the expected loads as with the EM on all 20
    layers = 20
    routes, _, _, expected = draw(3, 1.5, seed=4, layers=layers)
    raw = heat(routes)
    sub = token_mix.fit(routes, E, 3)
    every = token_mix.fit(routes, E, 3, layers=layers)
    assert sub.p.shape == every.p.shape == (W, 3, layers, E)

    def err(mix: token_mix.Mix) -> np.ndarray:  # [L] each layer's error against the expected loads
        return np.abs(mix.loads(raw) - expected).sum((0, 2))

    raw_err = np.abs(raw - expected).sum((0, 2))
    # every layer, those the EM did not read too (1-2, 4-5, ...), is de-mixed: nearer than the raw windows
    assert (err(sub) < 0.3 * raw_err).all()
    assert err(sub).sum() < 1.05 * err(every).sum()


def test_windows_at_equal_shares_are_nearer_the_expected_loads_than_the_raw_windows() -> None:
    routes, _, _, expected = draw(3, 1.5, seed=2)
    raw = heat(routes)
    at_equal = token_mix.fit(routes, E, 3).loads(raw)
    # every window keeps its picks up to the fit's noise: the ratio of two fitted rates is not renormalised
    assert np.allclose(at_equal.sum(-1), raw.sum(-1), rtol=0.005)
    err_mix = float(((at_equal - expected) ** 2).sum())
    err_raw = float(((raw - expected) ** 2).sum())
    assert err_mix < 0.25 * err_raw


def test_loads_at_the_windows_own_shares_are_the_raw_windows() -> None:
    routes, _, _, _ = draw(3, 1.5, seed=3)
    raw = heat(routes)
    mix = token_mix.fit(routes, E, 3)
    # the ratio form, raw x rates at the shares / rates at the window's own shares, each window at its own [W, D]
    assert np.allclose(mix.loads(raw, mix.shares), raw, rtol=1e-12)
    assert not np.allclose(mix.loads(raw), raw, rtol=1e-3)


@pytest.mark.parametrize(("kinds", "lean", "chosen"), [(3, 1.5, 4), (1, 0.0, 1)])
def test_aic_climbs_to_the_kinds_there_are(kinds: int, lean: float, chosen: int) -> None:
    """Three kinds: AIC falls to 2 and 4 (the ladder has no 3) and rises at 8; none (every token one router): it rises
    at 2, so the raw windows (1) stay."""
    routes = draw(kinds, lean, seed=4)[0]
    mix, aic = token_mix.choose_components(routes, E)
    assert mix.p.shape[1] == chosen
    assert min(aic, key=lambda d: aic[d]) == chosen
    assert list(aic) == [d for d in token_mix.COMPONENTS if d <= 2 * chosen]


def test_planning_loads_takes_the_mix_only_where_it_forecasts_better() -> None:
    mixed = draw(3, 1.5, seed=5)[0]
    src = token_mix.planning_loads(heat(mixed), mixed)
    assert src.name.startswith("mix: ")
    assert src.errors[src.name] < (1 - token_mix.MIN_GAIN) * src.errors["raw"]
    plain = draw(1, 0.0, seed=5)[0]
    src = token_mix.planning_loads(heat(plain), plain)
    assert src.name == "raw" and np.array_equal(src.loads, heat(plain))
    few = token_mix.planning_loads(heat(mixed)[:2], mixed[:2])
    assert few.name == "raw" and few.aic == {}
    assert token_mix.planning_loads(heat(mixed), None).name == "raw"


def test_raw_backtest_error_is_the_forecast_backtests_least() -> None:
    """backtest_error on the raw windows scored on themselves is forecast.backtest_errors' least (another sum)."""
    raw = heat(draw(3, 1.5, seed=6)[0])
    assert token_mix.backtest_error(lambda t: raw[:t], raw) == pytest.approx(float(backtest_errors(raw).min()),
                                                                             rel=1e-12)


def test_bad_input_names_the_field() -> None:
    routes = draw(3, 1.5, seed=7)[0]
    with pytest.raises(ValueError, match="components=0"):
        token_mix.fit(routes, E, 0)
    with pytest.raises(ValueError, match="windows: 5 routes for 6 windows"):
        token_mix.planning_loads(heat(routes), routes[:5])


def test_deterministic() -> None:
    routes = draw(3, 1.5, seed=8)[0]
    a, b = token_mix.planning_loads(heat(routes), routes), token_mix.planning_loads(heat(routes), routes)
    assert a.name == b.name and np.array_equal(a.loads, b.loads)


def test_a_mix_fitted_on_noise_does_not_plan() -> None:
    """Four kinds forced on windows of one router: the fit finds kinds in the noise and its windows forecast a hair
    better than the raw ones in the backtest (0.03% here), short of MIN_GAIN: the raw windows plan."""
    plain = draw(1, 0.0, seed=5)[0]
    src = token_mix.planning_loads(heat(plain), plain, components=(4,))
    mixes = [v for k, v in src.errors.items() if k != "raw"]
    assert (1 - token_mix.MIN_GAIN) * src.errors["raw"] < min(mixes) < src.errors["raw"]
    assert src.name == "raw" and np.array_equal(src.loads, heat(plain))


def test_r3trace_eplb_plans_ours_on_the_mix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace of 7 one-second windows drawn from three kinds, trained on the first 6: `r3trace eplb --policy ours`
    forecasts from token_mix.planning_loads of the windows' heat and their first --mix-tokens tokens, recomputed here
    from the ids written (the router drifts: planner.plan's mixed), says so in a line and the JSON; --mix-tokens 0
    plans on the raw windows, with no line; --keep-groups fits the mix only for a re-plan's early drift test on three
    windows, says so, and forecasts from the raw windows."""
    routes = draw(3, 1.5, seed=11, windows=W + 1, drift=1.5)[0]  # drift the backtest calls (forecast.drifts)
    ids = np.concatenate(routes).astype(np.int64)  # [7 T, L, 1]
    n = len(ids)
    ts = T0 + (np.arange(n) * 10**9) // T  # window w is second w
    with TraceWriter(tmp_path / "store", model_name="m", num_hidden_layers=L, moe_layer_ids=tuple(range(L)),
                     num_experts=E, top_k=1, run_id="a", num_groups=4, rows_per_file=6000) as w:
        w.append_tokens([f"r{i % 7}" for i in range(n)], np.arange(n), "decode", "computed", np.arange(n) // 8, ts, 0,
                        ids)
    cluster = Cluster(4, 2, 20, num_groups=4, node_limit=2)
    args = [str(tmp_path / "store"), "--gpus", "4", "--nodes", "2", "--slots", "20", "--node-limit", "2", "--groups",
            "4", "--policy", "ours", "--train", "time=..6", "--windows", "6"]
    history = heat(routes[:W])
    src = token_mix.planning_loads(history, [r[:MIX] for r in routes[:W]])
    assert src.name.startswith("mix: ")
    newest = ids[:W * T][-8192:]  # the in-sample replay sample ours' co-activation reads (--replay-tokens)
    plans = []
    for mix_tokens, mixed in ((MIX, src.mixed), (0, None)):
        capsys.readouterr()
        out = tmp_path / f"p{mix_tokens}.json"
        assert main(["eplb", *args, "--mix-tokens", str(mix_tokens), "--out", str(out)]) == 0
        lines = capsys.readouterr().out.splitlines()
        expected = plan_policy("ours", history, "ema", cluster, newest, None, "node-limited", 1, mixed=mixed)
        plans.append(expected.phy2log)
        np.testing.assert_array_equal(from_json(out.read_text())[0].phy2log, expected.phy2log)
        rep = json.loads(out.read_text())["meta"]["report"]
        said = [x for x in lines if x.startswith("forecast from: ")]
        if mix_tokens:
            assert rep["load_source"]["name"] == src.name and rep["load_source"]["used"] is True
            assert rep["load_source"]["backtest_errors"] == pytest.approx(src.errors, rel=1e-12)
            errs = ", ".join(f"{k} {v:.4g}" for k, v in src.errors.items())
            assert said == [f"forecast from: each history window at the long-run mix of its kinds of token "
                            f"({src.name}; AIC over {', '.join(str(d) for d in src.aic)} kinds; "
                            f"backtest squared rate error: {errs})"]
        else:
            assert rep["load_source"] is None and said == []
    assert not np.array_equal(*plans)  # the windows drift: the fresh plan forecasts from the de-mixed ones
    # --keep-groups: a fresh plan fits no mix (it would serve only the early drift test); a re-plan on three windows
    # fits it for that test, says so, and plans with the raw windows' forecast
    keep_args = [*args[:-4], "--keep-groups", "--windows", "3", "--train", "time=..3"]
    first, again = tmp_path / "keep.json", tmp_path / "keep_replan.json"
    assert main(["eplb", *keep_args, "--out", str(first)]) == 0
    three, newest3 = heat(routes[:3]), ids[:3 * T][-8192:]
    fresh = plan_policy("ours", three, "ema", cluster, newest3, None, "node-limited", 1, keep_groups=True)
    np.testing.assert_array_equal(from_json(first.read_text())[0].phy2log, fresh.phy2log)
    assert json.loads(first.read_text())["meta"]["report"]["load_source"] is None
    capsys.readouterr()
    assert main(["eplb", *keep_args, "--previous", str(first), "--out", str(again)]) == 0
    lines = capsys.readouterr().out.splitlines()
    src3 = token_mix.planning_loads(three, [r[:MIX] for r in routes[:3]])
    assert src3.name.startswith("mix: ")
    keep = plan_policy("ours", three, "ema", cluster, newest3, fresh, "node-limited", 1, keep_groups=True,
                       mixed=src3.mixed, demixed=src3.demixed)
    np.testing.assert_array_equal(from_json(again.read_text())[0].phy2log, keep.phy2log)
    rep = json.loads(again.read_text())["meta"]["report"]
    assert rep["load_source"]["name"] == src3.name and rep["load_source"]["used"] is False
    errs3 = ", ".join(f"{k} {v:.4g}" for k, v in src3.errors.items())
    assert [x for x in lines if x.startswith("forecast from: ")] == [
        f"forecast from: the raw windows (groups kept: {src3.name} serves only the early drift test on three windows; "
        f"AIC over {', '.join(str(d) for d in src3.aic)} kinds; backtest squared rate error: {errs3})"]


def test_the_planner_forecasts_from_the_mix_only_where_the_history_drifts() -> None:
    """planner.planning_forecast with the de-mixed windows: on windows of one unchanged router (only the mix moves:
    no drift called) the forecast is the raw windows' to the bit; on a drifting router it is the de-mixed windows'
    EMA at the weight that forecast the raw windows best."""
    cl = Cluster(4, 2, 20, num_groups=4, node_limit=2)
    still = draw(3, 1.5, seed=13, drift=0.0)[0]
    h = heat(still)
    src = token_mix.planning_loads(h, still)
    assert src.mixed is not None and not drifts(h, backtest_errors(h), PlannerConfig().refresh_drift)
    prev = plan(h[:3], cl)
    np.testing.assert_array_equal(planning_forecast(h, prev, PlannerConfig(), cl, src.mixed)[0],
                                  planning_forecast(h, prev, PlannerConfig(), cl)[0])
    moving = draw(3, 1.5, seed=15, drift=1.5)[0]
    h = heat(moving)
    src = token_mix.planning_loads(h, moving)
    assert src.mixed is not None and drifts(h, backtest_errors(h), PlannerConfig().refresh_drift)
    err, own = backtest_errors(src.mixed, h), backtest_errors(src.mixed)
    assert err is not None and own is not None
    assert pick_alpha(err) != pick_alpha(own)  # scored on the raw windows, another weight wins (1.0, not 0.7)
    expected = forecast(src.mixed, pick_alpha(err))
    for p in (None, prev):  # a fresh plan tests drift too
        got = planning_forecast(h, p, PlannerConfig(partner_backtest=False), cl, src.mixed)[0]
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_three_windows_keep_the_equal_share_windows_for_the_early_drift_test() -> None:
    """Source.demixed: with three windows, the windows at equal kind shares whichever source the backtest picked
    (token_mix.loads of the fit), the raw ones where AIC finds one kind; None with more windows or without a fit."""
    routes = draw(3, 1.5, seed=5)[0][:3]
    src = token_mix.planning_loads(heat(routes), routes)
    mix, _ = token_mix.choose_components(routes, E)
    assert mix.p.shape[1] > 1 and src.demixed is not None
    np.testing.assert_array_equal(src.demixed, np.round(mix.loads(heat(routes)), 3))
    plain = draw(1, 0.0, seed=5)[0][:3]
    one = token_mix.planning_loads(heat(plain), plain)
    assert one.demixed is not None and np.array_equal(one.demixed, heat(plain))
    assert token_mix.planning_loads(heat(draw(3, 1.5, seed=5)[0]), draw(3, 1.5, seed=5)[0]).demixed is None
    assert token_mix.planning_loads(heat(routes), None).demixed is None
