"""--policy auto's rule on hand-made fold scores (r3trace/eplb/backtest.py): the incumbent (ours + ema, the first in
table order) stays unless a candidate leads it by more than max(TIE, LEAD_SE standard errors of the lead); among
those that do, the best mean over the folds; a candidate ties with it when its mean gap is within max(TIE, the
standard error of its per-fold gap); of the tied, the fewest nodes per token, then table order. And the folds: the
newest FOLDS history windows, never the first."""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb.backtest import LEAD_SE, TIE, Candidate, choose, fold_windows, gap
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


def test_a_lead_within_two_standard_errors_keeps_the_incumbent() -> None:
    ours = cand("ours", "ema", [0.90, 0.92, 0.90, 0.92], nodes=2.0)
    other = cand("global", "mean", [0.95, 0.91, 0.95, 0.91], nodes=3.0)  # leads 0.05, -0.01, 0.05, -0.01
    m, se = gap(other, ours)
    assert m == pytest.approx(0.02) and se < m < LEAD_SE * se  # beyond one standard error, within two
    assert choose([other, ours]) is ours  # the incumbent is found by table order, not by list order
    assert choose([other, ours], lead_se=1.0) is other
    steady = cand("global", "mean", [0.93, 0.95, 0.93, 0.95], nodes=3.0)  # leads 0.03 in every fold: se 0
    assert choose([ours, steady]) is steady


def test_of_the_leaders_the_best_then_fewest_nodes_win() -> None:
    ours = cand("ours", "ema", [0.80, 0.80], nodes=1.5)
    a = cand("global", "mean", [0.90, 0.91], nodes=3.0)
    b = cand("global", "newest", [0.91, 0.90], nodes=2.5)  # tied with a (mean gap 0), fewer nodes
    c = cand("cross_node", "mean", [0.85, 0.85], nodes=1.0)  # leads ours beyond doubt, behind a and b beyond the tie
    assert choose([ours, a, b, c]) is b
    assert choose([ours, a, c]) is a


def test_with_one_forecast_the_incumbent_is_ours_on_it() -> None:
    """`--forecast mean`: the backtest holds the policies on that forecast only, and ours + mean is the incumbent."""
    ours = cand("ours", "mean", [0.90, 0.92, 0.90, 0.92])
    other = cand("global", "mean", [0.95, 0.91, 0.95, 0.91])  # a lead within two standard errors
    assert choose([other, ours]) is ours
