"""The dashboard's trade-off (r3trace/eplb/report_figures.tradeoff) plans each policy once for every node limit: that
holds only while no policy's plan reads the limit, which this checks for every policy, ours with groups kept too, and
the figures per limit against score_placement called here.

Run: .venv/bin/pytest tests/analysis/test_eplb_tradeoff.py -q
"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster
from r3trace.eplb.evaluate import POLICIES, plan_policy, score_placement
from r3trace.eplb.report_figures import KEEP_GROUPS, tradeoff


def _router(seed: int, windows: int = 3, n_tokens: int = 600, layers: int = 2, e: int = 32, k: int = 4
            ) -> tuple[np.ndarray, np.ndarray]:
    """history [W, L, E] and the newest window's tokens [T, L, K] of a Zipf(1) router with 8 groups (2 kept)."""
    rng = np.random.default_rng(seed)
    hist, tokens = [], None
    rank = np.stack([rng.permutation(e) for _ in range(layers)])
    for _ in range(windows):
        logits = -np.log1p(rank)[None] + rng.gumbel(size=(n_tokens, layers, e))
        grp = logits.reshape(n_tokens, layers, 8, e // 8).max(-1)
        keep = np.argsort(-grp, axis=-1)[..., :2]
        mask = np.zeros_like(grp, dtype=bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        tokens = np.argsort(-np.where(np.repeat(mask, e // 8, axis=-1), logits, -np.inf), axis=-1)[..., :k]
        hist.append(np.stack([np.bincount(tokens[:, li].ravel(), minlength=e) for li in range(layers)]))
    assert tokens is not None
    return np.stack(hist).astype(float), tokens


@pytest.mark.parametrize("nodes", [2, 4])
def test_no_plan_reads_the_node_limit(nodes: int) -> None:
    hist, tokens = _router(0)
    for policy in POLICIES:
        for keep in ((False, True) if policy == "ours" else (False,)):
            plans = [plan_policy(policy, hist, "ema" if policy == "ours" else "mean",
                                 Cluster(8, nodes, 40, num_groups=8, node_limit=limit), tokens, keep_groups=keep)
                     for limit in (1, nodes)]
            np.testing.assert_array_equal(plans[0].phy2log, plans[1].phy2log, err_msg=f"{policy} {keep}")


def test_tradeoff_points_are_each_plan_scored_at_each_limit() -> None:
    """Every point: the policy's plan on the history, scored on the newest window (no held-out one) at that limit."""
    from r3trace.eplb.report import Report

    hist, tokens = _router(1)
    cl = Cluster(8, 4, 40, num_groups=8, node_limit=2)
    rep = Report.__new__(Report)  # only the fields tradeoff reads
    object.__setattr__(rep, "history", hist)
    for name, value in (("held_heat", None), ("held_tokens", None), ("train_tokens", tokens),
                        ("dispatch", "node-limited"), ("top_k", 4)):
        object.__setattr__(rep, name, value)
    points = tradeoff(rep, cl, [1, 2, 4])
    assert {p.policy for p in points} == {*POLICIES, KEEP_GROUPS}
    for p in points:
        policy = "ours" if p.policy == KEEP_GROUPS else p.policy
        c = Cluster(8, 4, 40, num_groups=8, node_limit=p.node_limit)
        pl = plan_policy(policy, hist, "ema" if policy == "ours" else "mean", c, tokens,  # type: ignore[arg-type]
                         keep_groups=p.policy == KEEP_GROUPS)
        s = score_placement(pl, hist.sum(0), tokens, c)
        assert p.balancedness == s.balancedness_replay and p.nodes_per_token == s.nodes_mean
        assert s.token_nodes is not None and p.over_limit == float(np.mean(s.token_nodes > p.node_limit))
