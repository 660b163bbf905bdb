"""`r3trace eplb` held-out scores, every figure recomputed here with numpy from the rows written, not through
r3trace's scorer (eplb_cli_trace.py): the held-out and in-sample balancedness, nodes per token, the hindsight bound,
the dispatch each judges by, the backtest's candidates, and the plan from rollups equal to the plan from raw routes.

Run: .venv/bin/pytest tests/analysis/test_eplb_windows.py -q
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r3trace.analysis.store import TraceStore
from r3trace.eplb import Cluster, deepseek
from r3trace.eplb.placement import from_json
from r3trace.eplb.plan_request import PlanRequest
from r3trace.eplb.report import make_report
from r3trace.eplb.window import WindowSpec
from tests.analysis.eplb_cli_trace import (
    CLUSTER,
    L_IDS,
    T0,
    E,
    even_balancedness,
    heat,
    min_nodes,
    row,
    run_cli,
    write_trace,
)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return write_trace(tmp_path_factory.mktemp("store"))


def test_held_out_scores_equal_an_independent_scorer(trace: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Train on [0, 8) s, hold out [8, 12) s (the default --eval: what follows --train); global on the mean
    forecast plans on the training window's heat, so its phy2log is DeepSeek's policy on that heat."""
    out = tmp_path / "p.json"
    lines = run_cli(capsys, str(trace["root"]), *CLUSTER, "--policy", "global", "--train", "time=..8",
                    "--replay-tokens", "100000", "--out", str(out))
    ids, ts = trace["ids"], trace["ts"]
    train, held = ts < T0 + 8 * 10**9, ts >= T0 + 8 * 10**9
    cluster = Cluster(8, 4, 24, num_groups=4, node_limit=2)
    expected = deepseek.global_policy(heat(ids[train]), cluster).phy2log
    pl, _ = from_json(out.read_text())
    np.testing.assert_array_equal(pl.phy2log, expected)
    assert lines[:2] == ["train: time=0..8s of run a (8 windows), heat from rollups in 8 history windows",
                         "held out: time=8..12s of run a (4 windows)"]
    rep = json.loads(out.read_text())["meta"]["report"]
    got_held, got_in = rep["held_out_scores"], rep["in_sample"]
    bal_held, bal_in = even_balancedness(expected, heat(ids[held]), 8), even_balancedness(expected, heat(ids[train]), 8)
    assert got_held["balancedness_even"] == pytest.approx(bal_held, rel=1e-12)
    assert got_in["balancedness_even"] == pytest.approx(bal_in, rel=1e-12)
    assert bal_held < bal_in - 0.02  # the drift: held out is not in-sample
    nodes = min_nodes(expected, ids[held], 4)  # every held-out token replayed
    assert got_held["tokens"] == int(held.sum())
    assert got_held["nodes_per_token"] == pytest.approx(nodes.mean(), rel=1e-12)
    assert got_held["over_node_limit"] == pytest.approx((nodes > 2).mean(), rel=1e-12)
    assert row(lines, "balancedness (even split)") == [f"{bal_in:.4f}", f"{bal_held:.4f}"]
    assert row(lines, "nodes per token")[1] == f"{nodes.mean():.3f}"
    assert row(lines, "over node limit (2)")[1] == f"{(nodes > 2).mean():.2%}"
    worst = next(x for x in lines if x.startswith("worst layers (held out, node-limited dispatch):"))
    per_layer = nodes.mean(0)
    top = np.argsort(-per_layer, kind="stable")[:3]
    assert worst.endswith("nodes per token " + ", ".join(f"layer {L_IDS[i]} {per_layer[i]:.3f}" for i in top))
    assert rep["held_out_bound"] is None and not any(x.startswith("best on the held-out window") for x in lines)


def test_every_slot_one_expert_prints_the_hindsight_bound(trace: dict[str, Any], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """16 slots for 16 experts on 8 GPUs: two a GPU, where pairing the i-th hottest held-out expert with the i-th
    coldest is the best placement there is; the report's bound is that pairing's balancedness, above the plan's."""
    out = tmp_path / "p.json"
    lines = run_cli(capsys, str(trace["root"]), "--gpus", "8", "--nodes", "4", "--slots", "16", "--groups", "4",
                    "--policy", "global", "--train", "time=..8", "--out", str(out))
    held = heat(trace["ids"][trace["ts"] >= T0 + 8 * 10**9])  # [L, E]
    best = []
    for h in held:
        x = np.sort(h)[::-1]
        pairs = x[:8] + x[::-1][:8]  # the i-th hottest beside the i-th coldest
        best.append(pairs.mean() / pairs.max())
    rep = json.loads(out.read_text())["meta"]["report"]
    assert rep["held_out_bound"] == pytest.approx(float(np.mean(best)), rel=1e-12)
    plan = rep["held_out_scores"]["balancedness_even"]
    assert plan <= rep["held_out_bound"]
    assert (f"best on the held-out window (every slot one expert): balancedness (even split) <= "
            f"{np.mean(best):.4f} for any placement, in hindsight; this plan {plan:.4f}") in lines


def static_balancedness(phy2log: np.ndarray, ids: np.ndarray, gpus: int, nodes: int,
                        dynamic: bool = False) -> np.ndarray:
    """[L] mean/max GPU load when token t comes from rank t mod G and each rank sends expert x's pair to its own
    replica, else to its node's first where the node holds some but not all of x's replicas, else (the i-th rank
    left) to the replica (i + x) mod count of x's slots in ascending order: SGLang's static dispatch as
    r3trace/eplb/static.py models it, pair by pair; dynamic: a pair of a rank left goes 1 / count to every replica
    (SGLang's dynamic dispatch in expectation)."""
    per_gpu = phy2log.shape[1] // gpus
    per_node = gpus // nodes
    out = []
    for li in range(ids.shape[1]):
        load = np.zeros(gpus)
        slots = [np.flatnonzero(phy2log[li] == x) for x in range(E)]
        for x in range(E):
            mine = slots[x]
            gpu_of = mine // per_gpu

            def node_slot(g: int, mine: np.ndarray = mine, gpu_of: np.ndarray = gpu_of) -> int | None:
                same = mine[gpu_of // per_node == g // per_node]
                return int(same[0]) if 0 < len(same) < len(mine) else None

            lacking = [g for g in range(gpus) if g not in set(gpu_of.tolist()) and node_slot(g) is None]
            for t in np.flatnonzero((ids[:, li] == x).any(1)):
                g = t % gpus
                own = slots[x][gpu_of == g]
                near = own[0] if len(own) else node_slot(g)
                if near is None and dynamic:
                    for s in slots[x]:
                        load[s // per_gpu] += 1 / len(slots[x])
                    continue
                slot = near if near is not None else slots[x][(lacking.index(g) + x) % len(slots[x])]
                load[slot // per_gpu] += 1
        out.append(load.mean() / load.max())
    return np.array(out)


def test_static_dispatch_judges_the_backtest_and_worst_layers(trace: dict[str, Any], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """--dispatch static: the held-out SGLang-static figure equals the pair-by-pair count above, the worst layers are
    the lowest under it, and the backtest's folds (what the rule ranks) are each candidate's static figures."""
    out = tmp_path / "static.json"
    lines = run_cli(capsys, str(trace["root"]), *CLUSTER, "--train", "time=..8", "--windows", "4", "--dispatch",
                    "static", "--replay-tokens", "100000", "--out", str(out))
    doc = json.loads(out.read_text())
    pl, _ = from_json(out.read_text())
    rep = doc["meta"]["report"]
    held = trace["ts"] >= T0 + 8 * 10**9
    per_layer = static_balancedness(pl.phy2log, trace["ids"][held], 8, 4)
    assert rep["dispatch"] == "static"
    assert rep["held_out_scores"]["balancedness_static"] == pytest.approx(per_layer.mean(), rel=1e-12)
    assert row(lines, "balancedness (SGLang static)")[1] == f"{per_layer.mean():.4f}"
    low = np.argsort(per_layer, kind="stable")[:3]
    worst = next(x for x in lines if x.startswith("worst layers (held out, static dispatch): "))
    assert worst.split(": ", 1)[1].startswith(
        "balancedness " + ", ".join(f"layer {L_IDS[i]} {per_layer[i]:.4f}" for i in low) + ";")
    assert any("balancedness (SGLang's static dispatch replayed;" in x for x in lines)
    for c in rep["backtest"]["candidates"]:
        if c.get("folds"):
            assert np.mean(c["folds"]) == pytest.approx(c["balancedness_static"], rel=1e-12)
            assert c["balancedness_static"] != pytest.approx(c["balancedness_replay"], abs=1e-6)


def test_dynamic_dispatch_judges_the_backtest(trace: dict[str, Any], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--dispatch dynamic: the held-out SGLang-dynamic figure equals the pair-by-pair expectation, differs from the
    static and even-split ones, and the backtest's folds are each candidate's dynamic figures."""
    out = tmp_path / "dynamic.json"
    lines = run_cli(capsys, str(trace["root"]), *CLUSTER, "--train", "time=..8", "--windows", "4", "--dispatch",
                    "dynamic", "--replay-tokens", "100000", "--out", str(out))
    rep = json.loads(out.read_text())["meta"]["report"]
    pl, _ = from_json(out.read_text())
    held = trace["ts"] >= T0 + 8 * 10**9
    per_layer = static_balancedness(pl.phy2log, trace["ids"][held], 8, 4, dynamic=True)
    scores = rep["held_out_scores"]
    assert scores["balancedness_dynamic"] == pytest.approx(per_layer.mean(), rel=1e-12)
    assert row(lines, "balancedness (SGLang dynamic)")[1] == f"{per_layer.mean():.4f}"
    assert scores["balancedness_dynamic"] not in (scores["balancedness_static"], scores["balancedness_even"])
    assert any("balancedness (SGLang's dynamic dispatch replayed (in expectation);" in x for x in lines)
    for c in rep["backtest"]["candidates"]:
        if c.get("folds"):
            assert np.mean(c["folds"]) == pytest.approx(c["balancedness_dynamic"], rel=1e-12)


def ema_forecast(hist: np.ndarray) -> np.ndarray:
    """[W, L, E] -> [L, E]: the weight of ALPHAS whose one-window-ahead forecasts of windows 2 .. W - 1 had the least
    squared error in rates (0.35 with fewer than 3 windows), weights a (1 - a)^age normalised over the windows, in
    the newest window's scale (r3trace/eplb/planner.py's rule, recomputed here)."""
    rates = hist / hist.sum(-1, keepdims=True)

    def smooth(r: np.ndarray, a: float) -> np.ndarray:
        wt = np.ones(len(r)) if a == 0 else a * (1 - a) ** np.arange(len(r))[::-1]
        return np.einsum("w,wle->le", wt / wt.sum(), r)

    alphas = (0.0, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0)
    err = [sum(((rates[t] - smooth(rates[:t], a)) ** 2).sum() for t in range(2, len(rates))) for a in alphas]
    alpha = alphas[int(np.argmin(err))] if len(rates) >= 3 else 0.35
    return smooth(rates, alpha) * hist[-1].sum(-1, keepdims=True)


def test_auto_backtest_candidates_and_choice(trace: dict[str, Any], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--windows 4 on [0, 8) s: history windows of 2 s; rolling folds score [2, 4), [4, 6) and [6, 8) s, each from
    plans on the windows before it. Global's three forecasts are recomputed here per fold (the EMA with its
    backtested weight); the chosen candidate follows the stated rule on the printed figures: ours + ema unless a
    candidate leads it by more than max(0.005, 2 standard errors of the per-fold lead); of those, the best mean, tied
    within max(0.005, the standard error of the per-fold gap), fewest nodes per token."""
    out = tmp_path / "auto.json"
    lines = run_cli(capsys, str(trace["root"]), *CLUSTER, "--train", "time=..8", "--windows", "4",
                    "--replay-tokens", "100000", "--out", str(out))
    assert "auto: backtest over 3 folds: each history window of time=2..8s of run a (3 windows) scored from a plan " \
           "on the windows before it (the first fit on time=0..2s of run a); means over the folds" in lines
    ids, ts = trace["ids"], trace["ts"]
    sec = (ts - T0) // 10**9
    hist = np.stack([heat(ids[(sec >= a) & (sec < a + 2)]) for a in (0, 2, 4, 6)])  # [W, L, E]
    cluster = Cluster(8, 4, 24, num_groups=4, node_limit=2)
    rep = json.loads(out.read_text())["meta"]["report"]["backtest"]
    cands = {(c["policy"], c["forecast"]): c for c in rep["candidates"]}
    assert len(cands) == 12
    for how in ("mean", "newest", "ema"):
        bal, nodes = [], []
        for t in (1, 2, 3):
            w = {"mean": hist[:t].sum(0), "newest": hist[t - 1], "ema": ema_forecast(hist[:t])}[how]
            p2l = deepseek.global_policy(w, cluster).phy2log
            bal.append(even_balancedness(p2l, hist[t], 8))
            nodes.append(min_nodes(p2l, ids[(sec >= 2 * t) & (sec < 2 * t + 2)], 4).mean())
        assert cands[("global", how)]["balancedness_even"] == pytest.approx(np.mean(bal), rel=1e-9)
        assert cands[("global", how)]["nodes_per_token"] == pytest.approx(np.mean(nodes), rel=1e-12)
    folds = {k: np.array(c["folds"]) for k, c in cands.items()}
    assert all(len(f) == 3 for f in folds.values())

    def lead(a: tuple[str, str], b: tuple[str, str]) -> tuple[float, float]:  # a's per-fold lead over b: mean, se
        d = folds[a] - folds[b]
        return d.mean(), d.std(ddof=1) / np.sqrt(3)

    leaders = [k for k in folds if lead(k, ("ours", "ema"))[0] > max(0.005, 2 * lead(k, ("ours", "ema"))[1])]
    want = ("ours", "ema")
    if leaders:
        best = max(leaders, key=lambda k: folds[k].mean())
        want = min([k for k in leaders if lead(best, k)[0] <= max(0.005, lead(best, k)[1])],
                   key=lambda k: cands[k]["nodes_per_token"])
    assert rep["chosen"] == list(want)
    assert f"auto chose {want[0]} + {want[1]}" in lines


@pytest.mark.parametrize("policy", ["ours", "global", "hierarchical", "cross_node"])
@pytest.mark.parametrize("cluster", [Cluster(8, 4, 24, num_groups=4, node_limit=2),  # 4 groups on 4 nodes
                                     Cluster(8, 8, 24, num_groups=4, node_limit=4)])  # spread layout (ours)
def test_plan_from_rollups_equals_plan_from_routes(trace: dict[str, Any], policy: str, cluster: Cluster) -> None:
    """Same windows, heat read once from the rollups and once from the raw routes: identical phy2log."""
    if policy == "hierarchical" and cluster.num_groups % cluster.num_nodes:
        pytest.skip("hierarchical needs groups % nodes == 0")
    store = TraceStore(trace["root"])
    req = PlanRequest(cluster, policy, None, WindowSpec("time", None, 10), None, "a")  # type: ignore[arg-type]
    a = make_report(store, PlanRequest(**{**req.__dict__, "source": "rollups"}))
    b = make_report(store, PlanRequest(**{**req.__dict__, "source": "routes"}))
    assert a.source == "rollups" and b.source == "routes" and a.history_windows == 8
    np.testing.assert_array_equal(a.placement.phy2log, b.placement.phy2log)
    assert a.held is not None and b.held is not None
    assert a.held.balancedness_even == b.held.balancedness_even
