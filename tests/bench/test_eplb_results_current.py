"""BENCHMARKS.md's EPLB tables stay the current planner's: a few committed cells' ours rows re-run here must come out
as the result files hold them. A change to the planner that moves a plan fails this until the result files (and the
tables made from them) are measured again: `python -m bench.eplb_rerun --others` (the held-out matrix's files, then the
keep-groups, churn-curve and default-policy ones, each by its own bench).

The cells are the smallest: the sample model's traces (E = 32, 4 MoE layers, 5 held-out re-plans; ~15 s in all on the
2-core CPU machine): the held-out matrix's four, ours for SGLang's static and dynamic dispatch beside the default, and
the same four with groups kept (BENCHMARKS.md "EPLB with groups kept"); two SGLang-dump cells (no routes); and, marked
slow (`make test-all`, ~20 s), one cell of its router on a serving stream whose re-plans spend the churn budget. Rows
are compared to 1e-9: a plan that moved one slot shifts a window's balancedness by 1e-4 or more here.
Run: .venv/bin/pytest tests/bench/test_eplb_results_current.py -q
"""

from __future__ import annotations

import json

import pytest

from bench.eplb_matrix import Cell, run_cell
from bench.eplb_matrix_results import RESULTS
from bench.eplb_traces import TraceSpec


def _cells(name: str, pick: str = "") -> list[dict]:
    return [r for r in json.loads((RESULTS / name).read_text())["results"] if pick in r["cell"]]


def _rerun(row: dict, policies: tuple[str, ...], variants: bool = False) -> dict[str, dict]:
    cell = Cell(TraceSpec(**row["spec"]), row["gpus"], row["nodes"], row["slots"])
    return run_cell(cell, variants=variants, only=policies)["policies"]


def _same(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), where
    for metric, values in want.items():
        assert got[metric] == pytest.approx(values, rel=1e-9, abs=1e-12), f"{where}: {metric}"


@pytest.mark.parametrize("row", _cells("eplb-matrix-sample.json"), ids=lambda r: r["cell"])
def test_the_matrix_sample_cells_are_the_planners(row: dict) -> None:
    ours = ("ours", "ours-static", "ours-dynamic")
    got = _rerun(row, ours)
    for name in ours:
        _same(got[name], row["policies"][name], f"{row['cell']} {name}")


@pytest.mark.parametrize("row", _cells("eplb-keep-groups.json", "sample/"), ids=lambda r: r["cell"])
def test_the_keep_groups_sample_cells_are_the_planners(row: dict) -> None:
    got = _rerun(row, ("ours-keep-groups",), variants=True)
    _same(got["ours-keep-groups"], row["policies"]["ours-keep-groups"], row["cell"])


@pytest.mark.parametrize("name, cell, policy", [
    ("eplb-matrix-family-seed1.json", "sglang-dump/s=0.6/slow/g8/32x4x288", "ours"),
    ("eplb-keep-groups.json", "sglang-dump/s=1.2/fast/g8/16x2x288", "ours-keep-groups"),
])
def test_cells_without_routes_are_the_planners(name: str, cell: str, policy: str) -> None:
    """Two SGLang-dump cells (heat alone, E = 256, 17 re-plans; ~4 s each), whose re-plans call drift by the
    backtest without routes (drift_call.py: the t statistic, the held two-node call)."""
    (row,) = _cells(name, cell)
    got = _rerun(row, (policy,), variants=policy != "ours")
    _same(got[policy], row["policies"][policy], f"{name} {cell}")


@pytest.mark.slow
def test_the_churn_corner_cell_is_the_planners() -> None:
    """sample-mix 16 / 4 / 48 under slow drift, trace seed 0 (17 re-plans on the token mix, ~20 s): its still
    re-plans spend the whole churn budget, which the cells above never bind (PlannerConfig.seeded_churn_budget)."""
    (row,) = _cells("eplb-matrix-sample-mix.json", "sample-mix/s=0.6/slow/g4/16x4x48")
    _same(_rerun(row, ("ours",))["ours"], row["policies"]["ours"], row["cell"])
