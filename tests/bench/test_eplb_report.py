"""BENCHMARKS.md's EPLB tables (bench/eplb_report.py, bench/eplb_claims.py) against the result files they summarise.

Run: .venv/bin/pytest tests/bench/test_eplb_report.py -q   (CPU, about a second)
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.eplb_claims import MILP_ID, PLAN_TIME_ID, claims
from bench.eplb_report import SUMMARY_ID, summary_row
from bench.tables import load


def _cell(ours: list[float], glob: list[float], newest: list[float], ours_nodes: float, global_nodes: float
          ) -> dict[str, Any]:
    """A result of bench/eplb_matrix.py with two held-out windows; grace and node-limited are not summarised."""
    def pol(bal: list[float], nodes: float, churn: float = 0.9) -> dict[str, list[float]]:
        return {"bal_even": bal, "bal_node_limited": bal, "bal_static": bal, "nodes": [nodes, nodes],
                "over_limit": [0.0, 0.0], "churn": [churn, churn]}  # fmt: skip

    return {"cell": "x", "nodes": 4, "policies": {
        "ours": pol(ours, ours_nodes, 0.01 + ours[0] ** 8), "global": pol(glob, global_nodes),
        "global-newest": pol(newest, global_nodes), "grace": pol(glob, global_nodes)}}  # fmt: skip


def test_latest_json_holds_what_the_result_files_give() -> None:
    """latest.json's EPLB claims are what bench/eplb_claims.py computes from the committed result files: a result
    file rewritten without `python -m bench.eplb_report --latest` fails here."""
    latest = {c["id"]: c for c in load()["claims"]}
    for claim in claims():
        assert claim == latest[claim["id"]], f"{claim['id']}: run python -m bench.eplb_report --latest"
    assert {SUMMARY_ID, PLAN_TIME_ID, MILP_ID} <= set(latest)
    total = claims()[0]["rows"][-1]
    assert total["cells"] == "all cells" and total["n"] == sum(r["n"] for r in claims()[0]["rows"][:-1])


def test_summary_row_counts_and_differences() -> None:
    """Three cells worked by hand: (a) ours above both global policies on fewer nodes: yes; (b) below global by 0.10
    in both windows (SE 0): no; (c) above global, below global-newest by 0.01 +- 0.01 (paired SE of [-0.02, 0.0]),
    nodes won: tie. Differences vs global: +0.05, -0.10, +0.01."""
    cells = [
        _cell([0.90, 0.90], [0.85, 0.85], [0.80, 0.80], 2.0, 3.0),
        _cell([0.70, 0.70], [0.80, 0.80], [0.75, 0.75], 3.5, 3.0),
        _cell([0.80, 0.82], [0.79, 0.81], [0.82, 0.82], 2.5, 3.0),
    ]
    row = summary_row("three", cells)
    assert row["n"] == 3
    assert row["ge_global"] == "2 of 3" and row["ge_better"] == "1 of 3"
    assert row["verdicts"] == "1 / 1 / 1"
    assert row["nodes_le"] == "2 of 3"
    assert row["diff_median"] == pytest.approx(0.01) and row["diff_worst"] == pytest.approx(-0.10)
    assert row["nodes_diff_median"] == pytest.approx(-0.5)
    assert row["churn"] == "17.8% / 90%"  # medians of ours' 44.0%, 6.8%, 17.8% and global's 90% a re-plan


def test_first_replans_apart_from_later_ones() -> None:
    """The first FIRST (2) re-plans against the better global policy, apart from the later ones, worked by hand:
    (a) global is the better (0.85 vs 0.80): ours - it = -0.05, -0.05, then +0.05, +0.05; (b) global-newest is the
    better (0.73 vs 0.70): -0.01, +0.01, -0.01, +0.01. Means over cells: first (-0.05 + 0.0) / 2, later
    (+0.05 + 0.0) / 2."""
    cells = [
        _cell([0.80, 0.80, 0.90, 0.90], [0.85] * 4, [0.80] * 4, 2.0, 3.0),
        _cell([0.70, 0.72, 0.74, 0.76], [0.70] * 4, [0.71, 0.71, 0.75, 0.75], 2.0, 3.0),
    ]
    assert summary_row("two", cells)["first_later"] == "-0.0250 / +0.0250"


def test_pooled_verdict_pairs_the_windows_of_every_seed() -> None:
    """Worked by hand, ours - global (the better global here) per window. Seed 0: -0.03, +0.02 (-0.005 +- 0.025: a
    tie). With the cell on seed 1 at +0.01, +0.01: -0.03, +0.02, +0.01, +0.01 -> +0.0025, a yes. With two seeds at
    -0.05, -0.05: six windows -> -0.035 +- 0.0115, a miss over two standard errors: a no. Another cell's runs are
    not pooled."""
    seed0 = _cell([0.77, 0.82], [0.80, 0.80], [0.70, 0.70], 2.0, 3.0)
    up = _cell([0.81, 0.81], [0.80, 0.80], [0.70, 0.70], 2.0, 3.0)
    down = _cell([0.75, 0.75], [0.80, 0.80], [0.70, 0.70], 2.0, 3.0)
    assert summary_row("one", [seed0])["pooled"] == "0 / 1 / 0"
    assert summary_row("one", [seed0], {"x": [up]})["pooled"] == "1 / 0 / 0"
    assert summary_row("one", [seed0], {"x": [down, down]})["pooled"] == "0 / 0 / 1"
    assert summary_row("one", [seed0], {"y": [down]})["pooled"] == "0 / 1 / 0"  # another cell's seeds: not pooled
