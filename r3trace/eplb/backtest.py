"""`--policy auto`: the policy and forecast for the next window, chosen by backtest on the training window.

The training window's history windows are split into an earlier fit part and a later validation part
(window.split: the last quarter, at least one window). Every candidate policy x forecast plans on the fit
part and is scored on the validation part, held out from it; the rule below picks one, which then plans on
the whole training window.

Rule: the highest validation balancedness under node-limited dispatch (the even split when the trace has no
routes to replay); candidates within TIE of it count as tied, and of those the fewest nodes per token wins;
remaining ties go to the first in table order (policies as POLICIES, forecasts as FORECASTS).
TIE = 0.005: the held-out balancedness of one plan moves by 0.001-0.005 between seeds of the same synthetic
workload (BENCHMARKS.md, EPLB), so smaller gaps do not rank policies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from r3trace.eplb.evaluate import FORECASTS, POLICIES, Forecast, PolicyName, Score, plan_policy, score_placement
from r3trace.eplb.placement import Cluster, PlacementError

TIE = 0.005
RULE = (f"highest held-out balancedness (node-limited replay; even split without routes); within {TIE} of "
        "it, fewest nodes per token; then table order")


class Candidate(NamedTuple):
    policy: PolicyName
    forecast: Forecast
    score: Score | None  # None: the policy cannot plan this cluster (note says why)
    note: str = ""

    @property
    def balancedness(self) -> float:
        """What the rule ranks by: replayed when there were tokens, else the even split."""
        assert self.score is not None
        r = self.score.balancedness_replay
        return self.score.balancedness_even if r is None else r


def backtest(fit: np.ndarray, val_heat: np.ndarray, val_tokens: np.ndarray | None, cluster: Cluster,
             fit_tokens: np.ndarray | None = None, policies: Sequence[PolicyName] = POLICIES,
             forecasts: Sequence[Forecast] = FORECASTS) -> list[Candidate]:
    """fit [W, L, E] history, val_heat [L, E] and val_tokens [T, L, K] of the validation part -> every candidate
    scored there, in table order. fit_tokens (the fit part's newest routes) go to ours for co-activation."""
    out = []
    for policy in policies:
        for how in forecasts:
            try:
                pl = plan_policy(policy, fit, how, cluster, fit_tokens)
            except PlacementError as e:  # hierarchical when groups do not divide over nodes
                out.append(Candidate(policy, how, None, str(e)))
                continue
            out.append(Candidate(policy, how, score_placement(pl, val_heat, val_tokens, cluster)))
    return out


def choose(cands: Sequence[Candidate], tie: float = TIE) -> Candidate:
    """The candidate the rule (module doc) picks; needs at least one that planned."""
    ok = [c for c in cands if c.score is not None]
    if not ok:
        raise PlacementError("no candidate policy can plan this cluster: " + "; ".join(c.note for c in cands))
    best = max(c.balancedness for c in ok)
    tied = [c for c in ok if c.balancedness >= best - tie]
    return min(tied, key=lambda c: (c.score.nodes_mean or 0.0) if c.score is not None else 0.0)
