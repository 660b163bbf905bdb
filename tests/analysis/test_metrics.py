"""Metrics against independent numpy recomputation. Run: .venv/bin/pytest tests/analysis/test_metrics.py -q"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from r3trace.analysis import agreement, coactivation, heat, locality
from r3trace.analysis.store import TraceStore
from tests.analysis.conftest import MOE, E, K, write_run


def np_heat(ids: np.ndarray) -> np.ndarray:
    """[T, L, K] -> [L, E]"""
    return np.stack([np.bincount(ids[:, li].ravel(), minlength=E) for li in range(ids.shape[1])])


def test_heat_and_rollups_and_windows(tiny_trace: dict) -> None:
    s = TraceStore(tiny_trace["root"])
    want = np_heat(tiny_trace["ids"])
    for source in ("routes", "rollups"):
        df = heat.heat(s.con, "a", source=source)
        got = np.zeros_like(want)
        for lid, e, c in df.iter_rows():
            got[MOE.index(lid), e] = c
        assert np.array_equal(got, want), source
    # 4-second windows: forward f has ts = f seconds, so window w holds positions 4w..4w+3
    win = heat.heat_windows(s.con, 4.0, "a")
    w0 = win.filter(win["window_start"] == win["window_start"].min())
    pos = tiny_trace["pos"]
    assert w0["count"].sum() == int((pos < 4).sum()) * 3 * K
    rolled = heat.heat_windows(s.con, 4.0, "a", source="rollups")
    keys = ["window_start", "layer_id", "expert_id"]
    assert rolled.sort(keys).equals(win.sort(keys))
    decode = heat.heat(s.con, "a", phase="decode")
    assert decode["count"].sum() == int((tiny_trace["phase"] == "decode").sum()) * 3 * K


def test_imbalance_matches_numpy(tiny_trace: dict) -> None:
    s = TraceStore(tiny_trace["root"])
    h = np_heat(tiny_trace["ids"]).astype(float)
    df = heat.imbalance(s.con, "a")
    for li, row in enumerate(df.iter_rows(named=True)):
        c = h[li]
        p = c / c.sum()
        x = np.sort(c)
        n = len(x)
        gini = ((2 * np.arange(1, n + 1) - n - 1) * x).sum() / (n * x.sum())
        ent = -(p[p > 0] * np.log(p[p > 0])).sum() / np.log(E)
        assert row["max_over_mean"] == pytest.approx(c.max() / c.mean())
        assert row["cv"] == pytest.approx(c.std() / c.mean())
        assert row["norm_entropy"] == pytest.approx(ent)
        assert row["gini"] == pytest.approx(gini)


def test_coactivation_and_cross_layer(tiny_trace: dict) -> None:
    s = TraceStore(tiny_trace["root"])
    ids = tiny_trace["ids"]
    t = len(ids)
    layer = ids[:, 1]  # layer_id 2
    pairs: dict[tuple[int, int], int] = {}
    for row in layer:
        for a, b in combinations(sorted(row.tolist()), 2):
            pairs[(a, b)] = pairs.get((a, b), 0) + 1
    single = np.bincount(layer.ravel(), minlength=E)
    df = coactivation.coactivation(s.con, 2, "a")
    assert len(df) == len(pairs)
    for a, b, c, lift in df.iter_rows():
        assert c == pairs[(a, b)]
        assert lift == pytest.approx(c * t / (single[a] * single[b]))
    nxt = ids[:, 2]  # layer 2 -> next MoE layer is 4
    cond: dict[tuple[int, int], int] = {}
    for i_row, j_row in zip(layer, nxt, strict=True):
        for i in i_row.tolist():
            for j in j_row.tolist():
                cond[(i, j)] = cond.get((i, j), 0) + 1
    aff = coactivation.cross_layer_affinity(s.con, 2, "a")
    assert len(aff) == len(cond)
    for i, j, c, p in aff.iter_rows():
        assert c == cond[(i, j)] and p == pytest.approx(c / single[i])


def test_locality_specialisation_phase(tiny_trace: dict) -> None:
    s = TraceStore(tiny_trace["root"])
    ids, req, pos, phase = (tiny_trace[k] for k in ("ids", "req", "pos", "phase"))
    loc = locality.temporal_locality(s.con, "a")
    for li, row in enumerate(loc.iter_rows(named=True)):
        ov = []
        for r in np.unique(req):
            m = np.flatnonzero(req == r)
            m = m[np.argsort(pos[m])]
            ov += [len(set(ids[a, li]) & set(ids[b, li])) / K for a, b in zip(m[:-1], m[1:], strict=True)]
        assert row["pairs"] == len(ov) and row["mean_overlap"] == pytest.approx(np.mean(ov))
        pi = np.bincount(ids[:, li].ravel(), minlength=E) / len(ids)
        assert row["baseline"] == pytest.approx((pi**2).sum() / K)
    one = locality.temporal_locality(s.con, "a", layer_id=4)  # the layer filter reaches every part of the query
    assert one.to_dicts() == [r for r in loc.to_dicts() if r["layer_id"] == 4]
    spec = locality.specialisation(s.con, "tag", "a", layer_id=4)
    tag_of = np.array([tiny_trace["tags"][r] for r in req])
    glob = np.bincount(ids[:, 2].ravel(), minlength=E) / (len(ids) * K)
    for grp, _, tokens, kl, top in spec.iter_rows():
        c = np.bincount(ids[tag_of == grp, 2].ravel(), minlength=E)
        p = c / c.sum()
        assert tokens == (tag_of == grp).sum()
        assert kl == pytest.approx((p[p > 0] * np.log2(p[p > 0] / glob[p > 0])).sum())
        assert top == pytest.approx(np.sort(c)[::-1][:K].sum() / c.sum())
    pvd = locality.prefill_vs_decode(s.con, "a")
    for li, row in enumerate(pvd.iter_rows(named=True)):
        cp = np.bincount(ids[phase == "prefill", li].ravel(), minlength=E)
        cd = np.bincount(ids[phase == "decode", li].ravel(), minlength=E)
        assert row["tv_distance"] == pytest.approx(0.5 * np.abs(cp / cp.sum() - cd / cd.sum()).sum())
        assert row["prefill_tokens"] == (phase == "prefill").sum()


def test_agreement_against_perturbed_copy(tiny_trace: dict, tmp_path: Path) -> None:
    rng = np.random.default_rng(15)
    ids, req, pos, phase, fwd = (tiny_trace[k] for k in ("ids", "req", "pos", "phase", "fwd"))
    other = ids.copy()
    flip = rng.random(ids.shape[:2]) < 0.2  # replace one expert of 20% of (token, layer) sets
    for t, li in zip(*np.nonzero(flip), strict=True):
        free = np.setdiff1d(np.arange(E), other[t, li])
        other[t, li, rng.integers(K)] = rng.choice(free)
    write_run(tiny_trace["root"], "b", other, req, pos, phase, fwd)
    s = TraceStore(tiny_trace["root"])
    inter = np.array([[len(set(a) & set(b)) for a, b in zip(x, y, strict=True)]
                      for x, y in zip(ids, other, strict=True)])
    by = agreement.agreement_by_layer(s.con, "a", "b")
    assert by["overlap"].to_numpy() == pytest.approx(inter.mean(0) / K)
    assert by["jaccard"].to_numpy() == pytest.approx((inter / (2 * K - inter)).mean(0))
    assert by["exact_match"].to_numpy() == pytest.approx((inter == K).mean(0))
    summ = agreement.agreement_summary(s.con, "a", "b").row(0, named=True)
    assert summ["tokens_any_layer_different"] == pytest.approx((inter < K).any(1).mean())
    assert summ["exact_match_rate"] == pytest.approx((inter == K).mean())
    assert summ["rows_only_a"] == 0 and summ["matched_rows"] == inter.size
