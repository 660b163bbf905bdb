"""replan.py: seeding a subset of layers, the max-load floor, and which layers a drifting re-plan seeds.
Run: .venv/bin/pytest tests/analysis/test_eplb_replan.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster, PlannerConfig, global_policy, plan, replan
from r3trace.eplb.alignment import align
from r3trace.eplb.candidates import Contest, best_layout
from r3trace.eplb.churn_budget import seeded_counts, swap_shares
from r3trace.eplb.fresh import spread_cap, spread_layout
from r3trace.eplb.placement import Placement, from_phy2log
from r3trace.eplb.replan import floor_bound, max_load_floor, refreshed, seeded_plan
from r3trace.eplb.score import even_gpu_load

CL = Cluster(72, 18, 144, num_groups=8)  # 144/18/288 scaled down: 128 experts, 2 slots per GPU
L, E = 6, 128


def _history(seed: int, sigma: float, windows: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """([W, L, E] loads, [T, L, 8] newest tokens): Zipf(0.6) popularity plus a random walk of `sigma` a window."""
    rng = np.random.default_rng(seed)
    base = 1 / (1 + np.argsort(rng.random((L, E)), axis=1)) ** 0.6
    walk = np.exp(np.cumsum(rng.normal(0, sigma, (windows, L, E)), axis=0))
    tok = np.stack([np.stack([rng.choice(E, 8, replace=False) for _ in range(L)]) for _ in range(256)])
    return base * walk * 1000, tok


@pytest.mark.parametrize("seed", [1, 2])
def test_seeding_some_layers_gives_those_rows_of_seeding_all(seed: int) -> None:
    hist, tok = _history(seed, 0.3)
    cfg = PlannerConfig()
    prev = plan(hist[:3], CL, tokens=tok)
    w = hist[3:].sum(0)
    full = seeded_plan(w, prev, CL, cfg, spread_cap(CL), tok)
    some = np.arange(L) % 2 == 1
    part = seeded_plan(w, prev, CL, cfg, spread_cap(CL), tok, some)
    np.testing.assert_array_equal(part[some], full[some])
    np.testing.assert_array_equal(part[~some], prev.phy2log[~some])
    assert (full != prev.phy2log).any()  # the counts moved: something was seeded


def test_max_load_floor_is_under_every_placement_and_met_by_a_lone_hot_replica() -> None:
    rng = np.random.default_rng(3)
    w = rng.pareto(1.0, (L, E)) + 0.1
    glob = global_policy(w, CL)
    floor = max_load_floor(w, glob.logcnt, CL)
    assert (floor <= even_gpu_load(glob, w, CL).max(1) + 1e-9).all()
    for _ in range(20):  # random slot orders of the same counts
        ph = np.stack([rng.permutation(row) for row in glob.phy2log])
        assert (floor <= even_gpu_load(from_phy2log(ph, E), w, CL).max(1) + 1e-9).all()
    # one expert far hotter than the rest, alone: its GPU's load is the floor, met by pairing it with the lightest
    hot = np.ones((1, E))
    hot[0, 0] = 500.0
    cnt = np.ones((1, E), dtype=np.int64)
    cnt[0, 1:17] = 2  # 16 extras: P = 144
    assert max_load_floor(hot, cnt, CL)[0] == pytest.approx(500.0 + 0.5)


def _old_rule(fresh: Placement, w: np.ndarray, prev: Placement, cl: Cluster, cfg: PlannerConfig,
              tok: np.ndarray) -> np.ndarray:
    """A drifting re-plan seeding every layer first: the seeded plan, unless the fresh plan lowers the forecast max
    GPU load by more than refresh_gain on average; then every layer it lowers takes it, aligned to prev."""
    low = seeded_plan(w, prev, cl, cfg, spread_cap(cl), tok)
    ratio = even_gpu_load(from_phy2log(low, E), w, cl).max(1) / even_gpu_load(fresh, w, cl).max(1)
    if ratio.mean() <= 1 + cfg.refresh_gain:
        return low
    take = ratio > 1
    low[take] = align(fresh.phy2log[take], prev.phy2log[take], cl)
    return low


@pytest.mark.parametrize("seed", [5, 6])
def test_a_drifting_replan_seeds_floor_bound_layers_only(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cl = Cluster(32, 4, 160, num_groups=8)  # 5 slots a GPU: the mean GPU load sets the floor ...
    hist, tok = _history(seed, 0.3, windows=6)
    hist[:, 0, 7] *= 400  # ... except in layer 0, where one expert far hotter than the rest sets it
    prev = plan(hist[:5], cl, tokens=tok)
    w = hist[5]
    fresh = from_phy2log(best_layout(spread_layout(w, cl, PlannerConfig(), tok), w, cl, tok), E)  # eagerly, every layer
    contest = Contest(spread_layout(w, cl, PlannerConfig(), tok), w, cl, tok)  # the same fresh plan, chosen lazily
    exact = PlannerConfig(refresh_floor=-1.0)  # every layer seeded first
    np.testing.assert_array_equal(refreshed(contest, w, prev, cl, exact, spread_cap(cl), tok),
                                  _old_rule(fresh, w, prev, cl, exact, tok))
    cfg = PlannerConfig()
    logcnt, _ = seeded_counts(w, prev, cl, cfg, spread_cap(cl))
    np.testing.assert_array_equal(floor_bound(w, logcnt, cl, cfg.refresh_floor), np.arange(L) == 0)
    seeded_rows: list[np.ndarray] = []  # a spy around the real seeded_plan: which layers each call seeds

    def spy(*args: object, **kw: object) -> np.ndarray:
        seeded_rows.append(np.asarray(args[6]))
        return seeded_plan(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(replan, "seeded_plan", spy)
    out = refreshed(contest, w, prev, cl, cfg, spread_cap(cl), tok)
    monkeypatch.undo()
    # one call: layer 0 (floor-bound) and one probe (1 / 16 of the 5 others, rounded up); the rest are not seeded
    assert len(seeded_rows) == 1 and seeded_rows[0][0] and seeded_rows[0].sum() == 2
    old = _old_rule(fresh, w, prev, cl, cfg, tok)
    assert (old[1:] != prev.phy2log[1:]).mean() > 0.3  # the old rule refreshed: so does the new one, on layers 1..
    np.testing.assert_array_equal(out[1:], align(fresh.phy2log[1:], prev.phy2log[1:], cl))
    np.testing.assert_array_equal(out[0], old[0])  # the seeded layer as before
    # every layer a probe: every layer seeded, the old rule's plan exactly
    np.testing.assert_array_equal(refreshed(contest, w, prev, cl, PlannerConfig(refresh_probe=1), spread_cap(cl),
                                            tok),
                                  old)
    # a "fresh" plan no better than the seeded one: the probes keep theirs, so every layer is seeded (none left at
    # prev's) and none refreshed; seeded as refreshed seeds, without hot swaps (layer 0's fifth swap would be one)
    seeded = seeded_plan(w, prev, cl, cfg, spread_cap(cl), tok, hot=False)
    alone = Contest(seeded, w, cl, tok, compete=False)
    np.testing.assert_array_equal(refreshed(alone, w, prev, cl, cfg, spread_cap(cl), tok), seeded)


def test_swap_shares_split_evenly_and_give_the_remainder_to_the_least_balanced_layers() -> None:
    # hottest GPU over the mean: 1.1, 1.5, 1.0, 1.3, and a layer of no load (SGLang's dense rows): 0
    loads = np.array([[1.1, 0.9], [1.5, 0.5], [1.0, 1.0], [1.3, 0.7], [0.0, 0.0]])
    np.testing.assert_array_equal(swap_shares(13, loads), [3, 3, 2, 3, 2])
    np.testing.assert_array_equal(swap_shares(11, loads), [2, 3, 2, 2, 2])
    np.testing.assert_array_equal(swap_shares(4, loads), [1, 1, 1, 1, 0])
    np.testing.assert_array_equal(swap_shares(0, loads), [0] * 5)


def test_seeded_counts_hand_out_the_whole_budget_left_after_reseating() -> None:
    # the swaps [L] sum to the budget's slots left after the reseated counts, halved (2 slots a swap): an even split
    # alone left up to L - 1 of them unspent
    hist, tok = _history(5, 0.3)
    cfg = PlannerConfig()
    prev = plan(hist[:3], CL, tokens=tok)
    w = hist[3:].sum(0)
    logcnt, swaps = seeded_counts(w, prev, CL, cfg, spread_cap(CL))
    moved = int(np.abs(logcnt - prev.logcnt).sum()) // 2
    budget = int(cfg.seeded_churn_budget * prev.phy2log.size)
    assert swaps.sum() == (budget - moved) // 2 and swaps.max() - swaps.min() <= 1
    out = seeded_plan(w, prev, CL, cfg, spread_cap(CL), tok)
    assert (out != prev.phy2log).sum() <= budget
