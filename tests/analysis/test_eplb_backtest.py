"""--policy auto's rule on hand-made fold scores (r3trace/eplb/backtest.py): the best mean over the folds; a
candidate ties with it when its mean gap is within max(TIE, the standard error of its per-fold gap); of the tied,
the fewest nodes per token, then table order. And the folds: the newest FOLDS history windows, never the first."""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb.backtest import TIE, Candidate, choose, fold_windows, gap
from r3trace.eplb.evaluate import Score
from r3trace.eplb.placement import PlacementError


def cand(policy: str, forecast: str, bal: list[float], nodes: float | None = None) -> Candidate:
    """Folds with one layer each: replayed balancedness `bal` (even split 1.0, never ranked when replayed)."""
    return Candidate(policy, forecast, tuple(  # type: ignore[arg-type]
        Score(10, np.array([1.0]), np.array([b]), None if nodes is None else np.array([nodes]), None) for b in bal))


def test_fold_windows() -> None:
    assert fold_windows(8) == [4, 5, 6, 7]
    assert fold_windows(3) == [1, 2]
    assert fold_windows(2) == [1]


def test_lead_beyond_tie_and_standard_error_wins() -> None:
    best = cand("global", "newest", [0.95, 0.96, 0.92, 0.96], nodes=3.0)
    other = cand("ours", "ema", [0.94, 0.95, 0.91, 0.95], nodes=2.0)  # 0.010 behind in every fold: se 0
    assert gap(best, other) == pytest.approx((0.01, 0.0), abs=1e-12)
    assert choose([other, best]) is best


def test_gap_within_its_standard_error_ties_and_fewer_nodes_win() -> None:
    best = cand("global", "mean", [0.90, 0.99, 0.90, 0.99], nodes=3.0)
    other = cand("ours", "ema", [0.95, 0.91, 0.95, 0.91], nodes=2.0)  # mean gap 0.015 > TIE, se 0.0375
    m, se = gap(best, other)
    assert m == pytest.approx(0.015) and m > TIE and se == pytest.approx(np.std([-0.05, 0.08] * 2, ddof=1) / 2)
    assert choose([best, other]) is other
    assert choose([best, other], tie=0.0) is other  # the standard error alone ties them


def test_one_fold_ties_within_tie_then_table_order() -> None:
    a = cand("ours", "ema", [0.900])
    b = cand("global", "mean", [0.904])  # no routes: nodes None, so table order decides the tie
    assert choose([a, b]) is a
    assert choose([a, cand("global", "mean", [0.906])]).policy == "global"


def test_no_candidate_that_planned_raises() -> None:
    with pytest.raises(PlacementError, match="no candidate policy can plan this cluster: groups"):
        choose([Candidate("hierarchical", "mean", (), "groups do not divide")])
