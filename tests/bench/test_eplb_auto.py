"""bench/eplb_auto.py's scoring of pick rules from its file: picks rebuilt from the stored folds, held-out differences
against ours + ema and the best in hindsight, and the cell counts. Hand-made points, every figure known.

Run: .venv/bin/pytest -q tests/bench/test_eplb_auto.py
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from bench.eplb_auto import fixed, rule_auto, rule_rank_all, score_rules


def point(history: int, folds: dict[str, list[float]], held: dict[str, float]) -> dict[str, Any]:
    """A re-plan point: backtest folds per candidate (nodes 2.0 for ours, 3.0 else) and held-out replay figures."""
    return {"history": history,
            "backtest": {k: {"folds": v, "nodes": [2.0 if k.startswith("ours") else 3.0] * len(v)}
                         for k, v in folds.items()},
            "held": {k: {"replay": b, "even": b, "nodes": 2.0 if k.startswith("ours") else 3.0}
                     for k, b in held.items()}}


# global + mean leads ours + ema by 0.05, -0.01, 0.05, -0.01 over the folds: mean 0.02, one standard error 0.017
NOISY = {"ours/ema": [0.90, 0.92, 0.90, 0.92], "global/mean": [0.95, 0.91, 0.95, 0.91]}
# ... by 0.03 in every fold: beyond doubt
STEADY = {"ours/ema": [0.90, 0.90, 0.90, 0.90], "global/mean": [0.93, 0.93, 0.93, 0.93]}


def test_rules_pick_from_the_stored_folds() -> None:
    assert rule_auto(point(8, NOISY, {})) == "ours/ema"  # within two standard errors: the incumbent stays
    assert rule_rank_all(point(8, NOISY, {})) == "global/mean"  # beyond max(TIE, one): ranked first
    assert rule_auto(point(8, STEADY, {})) == rule_rank_all(point(8, STEADY, {})) == "global/mean"


def test_scores_against_ours_and_the_best_in_hindsight() -> None:
    held_a = {"ours/ema": 0.80, "global/mean": 0.70, "global/newest": 0.85}
    held_b = {"ours/ema": 0.90, "global/mean": 0.95, "global/newest": 0.90}
    cells = [{"points": [point(2, NOISY, held_a), point(3, STEADY, held_a)]},
             {"points": [point(2, NOISY, held_b), point(3, STEADY, held_b)]}]
    s = score_rules(cells, {"auto": rule_auto, "rank all": rule_rank_all, "global + mean": fixed("global/mean")})
    auto = s["auto"]  # picks ours, global, ours, global: -0.10 / 0 best 0.85 / +0.05 best 0.95
    assert auto["vs_ours"][0] == pytest.approx((0 - 0.10 + 0 + 0.05) / 4)
    assert auto["vs_best"] == pytest.approx((-0.05 - 0.15 - 0.05 + 0) / 4)
    assert auto["ours_share"] == 0.5 and auto["points"] == 4
    assert auto["nodes_vs_ours"] == pytest.approx(0.5)
    assert auto["by_history"][2] == [0.0, 0.0] and auto["by_history"][3][0] == pytest.approx(-0.025)
    g = s["global + mean"]  # cell a: -0.10 twice (behind beyond 2 SE: SE 0), cell b: +0.05 twice (ahead)
    assert g["vs_ours"][0] == pytest.approx(-0.025) and g["cells_behind"] == 1 and g["cells_ahead"] == 1
    assert s["rank all"]["vs_ours"][0] == pytest.approx(g["vs_ours"][0])  # it picked global + mean every time


def test_scores_read_the_dispatch_asked_for() -> None:
    """dispatch="static" scores the held-out SGLang-static figure, "dynamic" the SGLang-dynamic one (the even split
    where a point has none); each point's other figures are set apart so reading the wrong one fails."""
    p = point(2, STEADY, {"ours/ema": 0.80, "global/mean": 0.70})
    for name, fig in p["held"].items():
        fig["static"] = {"ours/ema": 0.60, "global/mean": 0.66}[name]
        fig["even"] = {"ours/ema": 0.50, "global/mean": 0.58}[name]
        fig["dynamic"] = {"ours/ema": 0.40, "global/mean": 0.43}[name]
    rules = {"global + mean": fixed("global/mean")}
    assert score_rules([{"points": [p]}], rules)["global + mean"]["vs_ours"][0] == pytest.approx(-0.10)
    assert score_rules([{"points": [p]}], rules, "static")["global + mean"]["vs_ours"][0] == pytest.approx(0.06)
    assert score_rules([{"points": [p]}], rules, "dynamic")["global + mean"]["vs_ours"][0] == pytest.approx(0.03)
    for fig in p["held"].values():  # a point without the figure (heat only): the even split
        fig["dynamic"] = None
    assert score_rules([{"points": [p]}], rules, "dynamic")["global + mean"]["vs_ours"][0] == pytest.approx(0.08)


def test_ours_on_ema_plans_on_the_token_mix_the_cli_hands_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each point's ours + ema plan gets token_mix.planning_loads of its history windows' heat and first MIX_TOKENS
    routes, as report.make_report hands it (the grouped router's fast drift: the newest point's history takes the
    mix, the earlier ones the raw windows, mixed None)."""
    import numpy as np

    from bench import eplb_auto
    from bench.eplb_traces import load_windows
    from r3trace.eplb.score import heat_of
    from r3trace.eplb.token_mix import planning_loads

    cell = eplb_auto.cells(True)[0]
    cell = replace(cell, spec=replace(cell.spec, family="grouped", windows=6))
    seen: list[Any] = []
    real = eplb_auto.plan_policy

    def spy(policy: str, history: Any, how: str, *args: Any, **kw: Any) -> Any:
        if (policy, how) == ("ours", "ema"):
            seen.append(kw["mixed"])
        return real(policy, history, how, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(eplb_auto, "plan_policy", spy)
    res = eplb_auto.run_cell(cell)
    routes = load_windows(cell.spec)[0]
    heats = np.stack([heat_of(w, cell.spec.num_experts) for w in routes])
    assert [p["load_source"] for p in res["points"]][-1].startswith("mix: ")
    assert len(seen) == len(res["points"])
    for got, p in zip(seen, res["points"], strict=True):
        lo, hi = max(0, p["t"] + 1 - eplb_auto.HISTORY), p["t"] + 1
        want = planning_loads(heats[lo:hi], [w[:eplb_auto.MIX_TOKENS] for w in routes[lo:hi]])
        assert want.name == p["load_source"]
        if want.mixed is None:
            assert got is None
        else:
            np.testing.assert_array_equal(got, want.mixed)
