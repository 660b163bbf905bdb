"""locality.locality_kept: with every slot one expert, a re-plan's layer that does not lower the max GPU load may not
spread the newest tokens over more nodes than the previous layer, unless it stays PlannerConfig.locality_slack under
DeepSeek global's; locality_refresh: a drifting re-plan's layer over global's nodes per token takes the fresh layout
where it holds the max load with fewer. Run: .venv/bin/pytest tests/analysis/test_eplb_locality.py -q"""

from __future__ import annotations

import numpy as np

from r3trace.eplb import Cluster, PlannerConfig, from_phy2log
from r3trace.eplb.candidates import Contest
from r3trace.eplb.locality import locality_kept, locality_refresh

# 16 nodes of 2 GPUs, 2 slots a GPU, 64 experts in 64 slots (P = E); slot s holds expert s: node of e = e // 4
CL = Cluster(32, 16, 64)
W = np.where(np.arange(64) < 4, 1000.0, 10.0)[None, :]  # [1, 64] experts 0-3 hot, on GPUs 0 and 1 of node 0
PREV = from_phy2log(np.arange(64)[None, :], 64)
TOKENS = np.tile(np.array([0, 1, 2, 3], dtype=np.int64), (600, 1))[:, None, :]  # [T, 1, K] every token on node 0


def _swapped(*pairs: tuple[int, int]) -> np.ndarray:
    ph = PREV.phy2log.copy()
    for a, b in pairs:
        ph[0, [a, b]] = ph[0, [b, a]]
    return ph


def test_a_layer_that_spreads_tokens_without_lowering_the_max_goes_back() -> None:
    one = _swapped((1, 63))  # expert 1 to node 15: GPU 1 (experts 2, 3) still holds 2,000, tokens now on 2 nodes
    out = locality_kept(one, PREV, W, CL, PlannerConfig(), TOKENS, glob=PREV.phy2log)
    np.testing.assert_array_equal(out, PREV.phy2log)
    # the same move where global's plan spreads those tokens over 4 nodes: 2 nodes is 50% under it, slack to spend
    wide = _swapped((1, 63), (2, 59), (3, 55))
    np.testing.assert_array_equal(locality_kept(one, PREV, W, CL, PlannerConfig(), TOKENS, glob=wide), one)
    # and off
    off = PlannerConfig(locality_slack=float("-inf"))
    np.testing.assert_array_equal(locality_kept(one, PREV, W, CL, off, TOKENS, glob=PREV.phy2log), one)


def test_a_layer_that_lowers_the_max_keeps_its_moves() -> None:
    two = _swapped((1, 63), (3, 61))  # every GPU at most 1,010: the max halves, the tokens cover 3 nodes
    np.testing.assert_array_equal(locality_kept(two, PREV, W, CL, PlannerConfig(), TOKENS, glob=PREV.phy2log), two)


def test_without_tokens_the_expected_nodes_decide() -> None:
    """No tokens (an SGLang dump): node_model.expected_nodes on the loads stands in for the count, the same verdicts."""
    one = _swapped((1, 63))
    out = locality_kept(one, PREV, W, CL, PlannerConfig(), None, glob=PREV.phy2log)
    np.testing.assert_array_equal(out, PREV.phy2log)
    wide = _swapped((1, 63), (2, 59), (3, 55))
    np.testing.assert_array_equal(locality_kept(one, PREV, W, CL, PlannerConfig(), None, glob=wide), one)
    inside = _swapped((1, 2))  # a swap inside node 0: the same node sets, the same expectation (not more nodes)
    out = locality_kept(inside, PREV, W, CL, PlannerConfig(), None, glob=PREV.phy2log)
    np.testing.assert_array_equal(out, inside)


def test_with_spare_slots_nothing_changes() -> None:
    spare = Cluster(32, 16, 64)
    w = np.where(np.arange(60) < 4, 1000.0, 10.0)[None, :]  # 60 experts in 64 slots: spare slots, the rule is P = E's
    ph = np.concatenate([np.arange(60), [0, 1, 2, 3]])[None, :]
    prev = from_phy2log(ph, 60)
    moved = ph.copy()
    moved[0, [1, 59]] = moved[0, [59, 1]]
    np.testing.assert_array_equal(locality_kept(moved, prev, w, spare, PlannerConfig(), TOKENS, glob=ph), moved)


def test_a_drifting_re_plan_takes_the_fresh_layout_where_it_holds_the_max_with_fewer_nodes() -> None:
    """locality.locality_refresh: the seeded layer `one` (hot experts on 2 nodes, max 2,000) against the fresh layout
    PREV (on node 0, max 2,000), with tokens and from loads alone."""
    one = _swapped((1, 63))
    fresh = Contest(PREV.phy2log, W, CL, TOKENS, compete=False)  # ours alone: PREV
    for tok in (TOKENS, None):
        out = locality_refresh(one, fresh, W, PREV, CL, PlannerConfig(), tok, glob=PREV.phy2log)
        np.testing.assert_array_equal(out, PREV.phy2log)
        # already under global's nodes per token (global's plan on 4 nodes): kept
        wide = _swapped((1, 63), (2, 59), (3, 55))
        np.testing.assert_array_equal(locality_refresh(one, fresh, W, PREV, CL, PlannerConfig(), tok, glob=wide), one)
        off = PlannerConfig(locality_gain=-1.0)
        np.testing.assert_array_equal(locality_refresh(one, fresh, W, PREV, CL, off, tok, glob=PREV.phy2log), one)
    # hot experts one a GPU (max 1,010) on nodes 0 and 1: the fresh layout's 2,000 does not hold the max load
    split = _swapped((1, 4), (3, 6))
    out = locality_refresh(split, fresh, W, PREV, CL, PlannerConfig(), TOKENS, glob=PREV.phy2log)
    np.testing.assert_array_equal(out, split)
