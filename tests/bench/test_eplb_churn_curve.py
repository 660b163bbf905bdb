"""bench/eplb_churn_curve.py: ours at several churn budgets beside DeepSeek's global policy, and the unchanged
workload (drift none) of bench/eplb_traces.py it runs on."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bench.eplb_churn_curve import BUDGETS, DEFAULT_BUDGET, FRESH, budget_name, curve_cells, rows_of, variants
from bench.eplb_matrix import run_cell
from bench.eplb_traces import PIECE, SAMPLE_ROUTES, TraceSpec, sample_mix_windows


def test_unchanged_workload_draws_every_domain_at_an_equal_share() -> None:
    # drift none keeps the domains' logits at 0: each request's domain is uniform over the five, so over 3 seeds x
    # 20 windows x 32 requests (1,920) every share is 0.2 +- 0.009 (one SE); 0.03 is 3.3 SE. Under fast drift the
    # shares walk away from 0.2 (sigma 0.3 a window; seeds 0-2: the widest share off by 0.13)
    z = np.load(SAMPLE_ROUTES)
    per = z["ids"].shape[1] // PIECE
    ids = z["ids"][:, : per * PIECE].astype(np.int16).reshape(-1, PIECE, *z["ids"].shape[2:])
    pool = {p.tobytes(): int(d) for p, d in zip(ids, np.repeat(z["domain"], per), strict=True)}
    spec = TraceSpec(family="sample-mix", num_experts=32, num_groups=4, top_k=4, num_layers=4, windows=20)

    def shares(drift: str) -> np.ndarray:
        doms = [pool[r.tobytes()] for seed in range(3)
                for w in sample_mix_windows(replace(spec, drift=drift, seed=seed))
                for r in w.reshape(-1, PIECE, 4, 4)]
        return np.bincount(doms, minlength=5) / len(doms)

    assert np.abs(shares("none") - 0.2).max() < 0.03
    assert np.abs(shares("fast") - 0.2).max() > 0.06


def _res(cell: str, drift: str, seed: int, ours: list[float], glob: list[float], newest: list[float],
         churn: list[float]) -> dict:
    pol = {"nodes": [1.0] * len(ours), "churn": churn}
    names = ["ours", *(budget_name(b) for b in BUDGETS if b != DEFAULT_BUDGET), FRESH]
    pols = {n: {**pol, "bal_even": ours} for n in names}
    pols["global"] = {"nodes": [2.0] * len(ours), "churn": [0.9] * len(ours), "bal_even": glob}
    pols["global-newest"] = {"nodes": [2.0] * len(ours), "churn": [0.95] * len(ours), "bal_even": newest}
    return {"cell": cell, "spec": {"drift": drift, "seed": seed}, "policies": pols}


def test_rows_pool_seeds_per_cell_against_the_better_global() -> None:
    res = [_res("a", "slow", 0, [0.80, 0.82], [0.81, 0.83], [0.70, 0.70], [0.05, 0.09]),
           _res("a", "slow", 1, [0.84, 0.80], [0.83, 0.85], [0.70, 0.70], [0.07, 0.08]),
           _res("b", "slow", 0, [0.90, 0.92], [0.80, 0.80], [0.85, 0.95], [0.06, 0.06])]
    rows = {r["policy"]: r for r in rows_of(res)}
    ours = rows["ours"]
    # cell a: pooled over seeds, ours - global = (-0.01 - 0.01 + 0.01 - 0.05) / 4 = -0.015; cell b: global newest
    # (0.90) beats global (0.80), ours - it = +0.01
    assert ours["cells"] == 2 and ours["gap_mean"] == pytest.approx((-0.015 + 0.01) / 2)
    assert ours["gap_worst"] == pytest.approx(-0.015)
    assert ours["churn_mean"] == pytest.approx(np.mean([0.05, 0.09, 0.07, 0.08, 0.06, 0.06]))
    assert ours["churn_max"] == pytest.approx(0.09)
    # a: -0.015 against a paired SE of 0.0126 -> tie (within 2 SE); b: yes
    assert ours["verdicts"] == "1 / 1 / 0"
    assert rows["global"]["verdicts"] == "-" and rows["global"]["gap_mean"] == pytest.approx((0 + -0.1) / 2)
    assert not any(r["drift"] == "none" for r in rows.values())


def test_budgets_bound_the_slots_each_row_moves() -> None:
    # one sample-mix cell, unchanged workload, 6 windows: every budgeted row's re-plans stay within its budget and
    # a larger budget moves more; the fresh plan, aligned, moves far more than any budget
    cell = curve_cells(0)[0]
    cell = type(cell)(replace(cell.spec, drift="none", windows=6), cell.gpus, cell.nodes, cell.slots)
    res = run_cell(cell, only=("global", "ours"), extra=variants)
    p = res["policies"]
    for b in BUDGETS:
        assert max(p[budget_name(b)]["churn"]) <= b
    assert np.mean(p[budget_name(0.3)]["churn"]) > np.mean(p["ours"]["churn"])
    assert np.mean(p[FRESH]["churn"]) > 0.3
