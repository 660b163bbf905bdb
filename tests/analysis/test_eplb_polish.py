"""polish.py: the last local search of a fresh plan on small layers (max GPU load, never more nodes per token)."""

from __future__ import annotations

import numpy as np
import pytest

import r3trace.eplb.polish as polish_mod
from r3trace.eplb import Cluster, PlannerConfig, plan
from r3trace.eplb.cover import cover, node_masks
from r3trace.eplb.placement import check_placement, from_phy2log
from r3trace.eplb.polish import polish
from r3trace.eplb.score import even_gpu_load

CL = Cluster(4, 2, 20, num_groups=4)  # bench/eplb_milp.py's synth-e16 shape: 16 experts, 5 slots per GPU


def _instance(seed: int = 0, e: int = 16, k: int = 2, t: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """bench/eplb_milp.py's synth-e16 (seed 0): Zipf(0.8) choices of K distinct experts, loads = their counts."""
    rng = np.random.default_rng(seed)
    pop = 1 / np.arange(1, e + 1) ** 0.8
    tok = np.stack([rng.choice(e, k, replace=False, p=pop / pop.sum()) for _ in range(t)])
    return np.bincount(tok.ravel(), minlength=e).astype(float), tok


def _scores(p2l: np.ndarray, load: np.ndarray, tok: np.ndarray) -> tuple[float, float]:
    mx = float(even_gpu_load(from_phy2log(p2l, len(load)), load[None], CL).max())
    return mx, float(cover(node_masks(p2l, len(load), CL), tok, CL)[0])


def test_reaches_the_milp_optimum_on_synth_e16_without_more_nodes() -> None:
    # HiGHS proves 20.0 optimal on this instance (BENCHMARKS.md, EPLB MILP table); the plan before the polish
    # stops at 20.5, which no single swap or recount lowers (a 2-for-2 exchange does); planned for the even split
    # (the MILP's objective), without the two-node replay contest (dispatch_contest.py)
    load, tok = _instance()
    before = plan(load[None], CL, tokens=tok[:, None], cfg=PlannerConfig(polish_steps=0, replay_margin=-1.0))
    after = plan(load[None], CL, tokens=tok[:, None], cfg=PlannerConfig(replay_margin=-1.0))
    check_placement(after, CL)
    mx0, n0 = _scores(before.phy2log, load, tok)
    mx1, n1 = _scores(after.phy2log, load, tok)
    assert mx0 == 20.5 and mx1 == 20.0
    assert n1 <= n0


def test_node_rules_hold_on_random_layers() -> None:
    rng = np.random.default_rng(3)
    for seed in range(4):
        load, tok = _instance(seed + 1)
        p2l = plan(load[None], CL, tokens=tok[:, None], cfg=PlannerConfig(polish_steps=0)).phy2log
        m0 = node_masks(p2l, 16, CL)
        mx0, n0 = _scores(p2l, load, tok)
        w = load[None] * rng.uniform(0.9, 1.1, 16)  # a forecast a little off the tokens' counts
        for rule in ("cover", "keep", "fixed"):
            out = polish(p2l, w, CL, tok[:, None], 64, rule)
            assert (np.bincount(out[0], minlength=16) >= 1).all() and out.shape == p2l.shape
            m1 = node_masks(out, 16, CL)
            mx1 = float(even_gpu_load(from_phy2log(out, 16), w, CL).max())
            assert mx1 <= float(even_gpu_load(from_phy2log(p2l, 16), w, CL).max()) + 1e-9
            if rule == "fixed":
                np.testing.assert_array_equal(m1, m0)
            if rule == "keep":
                assert ((m1 & m0) == m0).all()  # node sets only grow: no token's cover can
            assert cover(m1, tok, CL)[0] <= n0 + 1e-12


def test_kicks_never_raise_nodes_per_token_under_a_forecast() -> None:
    # forecast weights a little off the tokens' counts, so balance and locality pull apart; seed 8 is a layer where
    # kicks that ignored the cover rule ended at 1.2 nodes per token from 1.075
    rng = np.random.default_rng(3)
    for seed in range(12):
        load, tok = _instance(seed)
        p2l = plan(load[None], CL, tokens=tok[:, None], cfg=PlannerConfig(polish_steps=0)).phy2log
        w = load[None] * rng.uniform(0.9, 1.1, 16)
        out = polish(p2l, w, CL, tok[:, None], 64, "cover")
        assert _scores(out, load, tok)[1] <= _scores(p2l, load, tok)[1] + 1e-12, seed
        mx = [float(even_gpu_load(from_phy2log(x, 16), w, CL).max()) for x in (p2l, out)]
        assert mx[1] <= mx[0] + 1e-9, seed


def test_large_layers_are_left_alone() -> None:
    cl = Cluster(32, 4, 288)
    rng = np.random.default_rng(1)
    p2l = np.stack([rng.permutation(np.r_[np.arange(256), rng.integers(0, 256, 32)]) for _ in range(2)])
    np.testing.assert_array_equal(polish(p2l, rng.random((2, 256)) + 0.1, cl, None, 64), p2l)


def test_kicks_reach_the_mean_where_the_descent_stops_above_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # bench/eplb_milp.py's sample-e32 (8 GPUs / 2 nodes / 40 slots), from the layout that bench's plan hands the
    # polish: the descent alone stops at 48.5, the kicked rounds reach the mean GPU load 48.0 (so the optimum, as HiGHS
    # also proves) with fewer nodes per token; the search for fewer nodes after them (cover.py, which lowers the max
    # load too) is off here
    import dataclasses

    import r3trace.eplb.cover as cover_mod
    from bench.eplb_milp import EVEN_SPLIT, instance

    monkeypatch.setattr(cover_mod, "COVER_ROUNDS", 0)
    load, tok, cl = instance("sample-e32")
    before = plan(load[None], cl, tokens=tok[:, None], cfg=dataclasses.replace(EVEN_SPLIT, polish_steps=0)).phy2log
    got = {}
    for kicks in (0, polish_mod.KICKS):
        monkeypatch.setattr(polish_mod, "KICKS", kicks)
        out = polish(before, load[None], cl, tok[:, None], 64, "cover")
        check_placement(from_phy2log(out, len(load)), cl)
        mx = float(even_gpu_load(from_phy2log(out, len(load)), load[None], cl).max())
        got[kicks] = (mx, float(cover(node_masks(out, len(load), cl), tok, cl)[0]))
    n_before = float(cover(node_masks(before, len(load), cl), tok, cl)[0])
    assert got[0][0] == pytest.approx(48.5) and got[polish_mod.KICKS][0] == pytest.approx(load.sum() / 8)
    assert got[polish_mod.KICKS][1] < got[0][1] <= n_before + 1e-12


@pytest.mark.parametrize("seed", range(8))
def test_move_keys_are_the_written_out_layouts_keys_bit_for_bit(seed: int) -> None:
    """polish_moves.move_keys re-sums only the GPUs a count-keeping move touches; its keys must be the very bits of
    layout_keys on every candidate written out (the descent compares them within 1e-9 of the mean GPU load, and a
    different rounding would pick another move): odd shapes, 1-12 slots a GPU, 1-4 nodes."""
    from r3trace.eplb.polish_moves import apply, layout_keys, move_keys, neighbours

    rng = np.random.default_rng(seed)
    for _ in range(6):
        g = int(rng.choice([2, 3, 4, 6, 8]))
        spg = int(rng.integers(1, 13))
        p = g * spg
        e = int(rng.integers(max(1, p // 3), p + 1))
        ph = np.concatenate([np.arange(e), rng.integers(0, e, p - e)])
        rng.shuffle(ph)
        pick = rng.integers(3)  # integer loads (ties), gamma loads, or equal loads (every GPU at the max)
        w = (rng.integers(0, 40, e).astype(float), rng.gamma(0.5, 10.0, e), np.full(e, 3.0))[pick]
        cl = Cluster(g, int(rng.choice([n for n in (1, 2, 4) if g % n == 0])), p)
        tol = 1e-9 * max(float(w.sum()) / g, 1e-12)
        mv = neighbours(ph, w, cl)
        written = apply(ph, mv, np.arange(len(mv.slots)))
        assert (np.sort(written, 1) != np.sort(ph)).any(1).sum() <= (mv.partner < 0).sum()  # only recounts recount
        np.testing.assert_array_equal(move_keys(ph, w, cl, tol, mv), layout_keys(written, w, cl, tol))


def test_many_slots_a_gpu_stay_with_the_leveling() -> None:
    # 16 slots a GPU: a step would score ~100K exchanges; [48, 128] on 8 GPUs took 2.3 s a plan for no held-out gain
    rng = np.random.default_rng(11)
    w = rng.gamma(0.6, 100.0, (1, 128))
    ph = rng.permutation(128)[None]  # a random layout, far from balanced
    np.testing.assert_array_equal(polish(ph, w, Cluster(8, 1, 128), None, 64), ph)
    ph8 = rng.permutation(64)[None]
    w8 = rng.gamma(0.6, 100.0, (1, 64))
    cl8 = Cluster(8, 1, 64)
    before = even_gpu_load(from_phy2log(ph8, 64), w8, cl8).max()
    assert even_gpu_load(from_phy2log(polish(ph8, w8, cl8, None, 64), 64), w8, cl8).max() < before  # 8 a GPU: polished
