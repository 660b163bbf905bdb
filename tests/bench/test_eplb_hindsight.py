"""r3trace/eplb/hindsight.py and bench/eplb_hindsight.py: the P = E bound on max GPU load never exceeds the true
optimum (brute force over every placement) and equals it for two slots a GPU; the clairvoyant's tokens come from the
window's own router without touching the windows; a cell's figures and the claim's rows.
Run: .venv/bin/pytest tests/bench/test_eplb_hindsight.py -q"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from bench import eplb_hindsight
from bench.eplb_hindsight import FIRST_SCORED, fresh_plans, hindsight_claim, hindsight_spec, run
from bench.eplb_traces import TraceSpec, load_windows, oracle_heats, synth_windows
from r3trace.eplb import Cluster
from r3trace.eplb.hindsight import bound, max_load_floor
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of


def optimum(x: np.ndarray, gpus: int) -> float:
    """The least max GPU load over every split of the experts into `gpus` sets of equal size (brute force)."""
    s = len(x) // gpus
    best = np.inf

    def rec(rest: list[int], worst: float) -> None:
        nonlocal best
        if worst >= best:
            return
        if not rest:
            best = worst
            return
        for comb in itertools.combinations(rest[1:], s - 1):
            grp = (rest[0], *comb)
            rec([r for r in rest if r not in grp], max(worst, float(x[list(grp)].sum())))

    rec(list(range(len(x))), 0.0)
    return best


@pytest.mark.parametrize(("gpus", "slots"), [(2, 2), (3, 2), (4, 2), (2, 3), (3, 3), (2, 4)])
def test_the_floor_is_a_lower_bound_and_exact_for_pairs(gpus: int, slots: int) -> None:
    rng = np.random.default_rng(gpus * 10 + slots)
    exact = 0
    for trial in range(40):
        x = rng.zipf(1.3, gpus * slots).astype(float) if trial % 2 else rng.random(gpus * slots) * 10
        got, best = float(max_load_floor(x[None], gpus)[0]), optimum(x, gpus)
        assert got <= best + 1e-9, (x, got, best)
        exact += abs(got - best) < 1e-9
        if slots == 2:
            assert got == pytest.approx(best, abs=1e-12)
    assert exact >= 10  # the bound is not vacuous: it meets the optimum on many of the random instances


def test_the_floor_per_layer_and_bound_as_balancedness() -> None:
    heat = np.array([[10.0, 1, 1, 0], [4, 4, 4, 4], [0, 0, 0, 0]])  # [L, E] on 2 GPUs of 2 slots
    assert max_load_floor(heat, 2).tolist() == [10.0, 8.0, 0.0]
    assert bound(heat, 2) == pytest.approx((6 / 10 + 8 / 8) / 2)  # the empty layer is left out
    with pytest.raises(ValueError, match="num_experts=4 is not a multiple of gpus=3"):
        max_load_floor(heat, 3)


def test_oracle_tokens_come_from_each_windows_router() -> None:
    spec = TraceSpec(family="independent", drift="fast", zipf_s=0.3, num_layers=2, windows=5, window_tokens=4096)
    routes, oracle = oracle_heats(spec, 16384)
    assert np.array_equal(routes, synth_windows(spec))  # the windows keep their bytes
    assert oracle.shape == (5, 2, 256) and np.all(oracle.sum(-1) == 16384 * spec.top_k)
    rates = oracle / oracle.sum(-1, keepdims=True)
    seen = np.stack([heat_of(w, 256) for w in routes])
    seen = seen / seen.sum(-1, keepdims=True)
    # each window is nearest (L1 over layers) to the oracle drawn from its own drift state, not a neighbour's
    dist = np.abs(rates[:, None] - seen[None]).sum((-1, -2))  # [oracle window, seen window]
    assert np.array_equal(dist.argmin(0), np.arange(5))


def test_a_cell_then_the_claims_rows(tmp_path: Path) -> None:
    spec = TraceSpec(family="grouped", zipf_s=1.2, num_layers=2, windows=5, window_tokens=1024)
    res = {"cell": "c", "spec": spec.__dict__, "gpus": 128, "nodes": 16, "slots": 256,
           "policies": {"ours": {"bal_even": [0.1, 0.1]}}}
    (out,) = hindsight_spec([res])
    assert len(out["bound"]) == len(out["found"]) == len(out["clairvoyant"]) == 2  # windows 3 and 4
    routes = synth_windows(spec)
    cl = Cluster(128, 16, 256, num_groups=8)
    for i, t in enumerate((3, 4)):
        h = heat_of(routes[t], 256)
        assert out["bound"][i] == pytest.approx(bound(h, 128))
        # two slots a GPU: the bound is exact and DeepSeek's sorted pairing on the window's own loads reaches it
        assert out["found"][i] == pytest.approx(out["bound"][i], abs=1e-12)
        assert out["clairvoyant"][i] <= out["bound"][i] + 1e-12
    assert cl.slots_per_gpu == 2

    def cell(name: str, verdict: str, ours: float, clair: float | None, found: float | None, tight: int) -> dict:
        return {"cell": name, "verdict": verdict, "ours": ours, "global": 0.5, "global-newest": 0.52,
                "clairvoyant": clair, "found": found, "bound": None if found is None else 0.6, "windows": 3,
                "tight_windows": tight, "seeds": [0, 1]}

    doc = {"oracle_tokens": 32768, "cells": [cell("spare", "tie", 0.5, 0.57, None, 0),
                                             cell("a", "tie", 0.51, 0.53, 0.6, 3),
                                             cell("b", "yes", 0.55, 0.56, 0.58, 1),
                                             cell("c", "yes", 0.57, None, 0.59, 0)]}
    path = tmp_path / "h.json"
    path.write_text(json.dumps(doc))
    rows = hindsight_claim(path)["rows"]
    assert [r["cells"] for r in rows] == ["a", "spare", "the other 2 P = E cells, medians"]  # P = E ties first
    a, spare, rest = rows
    assert (a["verdict"], a["better"], a["clairvoyant"], a["optimum"], a["room_clair"], a["room_bound"],
            a["room_share"], a["ours_better"]) == ("tie", "0.52000", "0.53000", "0.60000", "+0.01000", "+0.08000",
                                                   "15.4%", "-0.01000")
    # with spare slots: no bound, no hindsight optimum; the clairvoyant's room still
    assert (spare["optimum"], spare["room_bound"], spare["room_share"]) == ("-", "-", "-")
    assert spare["room_clair"] == "+0.05000"
    assert rest["verdict"] == "2 yes" and rest["optimum"] == "0.58500 - 0.60000"  # not tight: found - bound
    assert rest["clairvoyant"] == "0.56000" and rest["ours_better"] == "+0.04000"  # medians of the cells that have it


def test_a_cell_with_spare_slots_gets_the_clairvoyant_only() -> None:
    spec = TraceSpec(family="clustered", zipf_s=0.6, drift="fast", num_layers=2, windows=5, window_tokens=1024)
    res = {"cell": "c", "spec": spec.__dict__, "gpus": 16, "nodes": 2, "slots": 288,
           "policies": {"ours": {"bal_even": [0.1, 0.1]}}}
    (out,) = hindsight_spec([res], oracle_tokens=4096)
    assert out["bound"] == out["found"] == [] and len(out["clairvoyant"]) == 2
    assert all(0.3 < v <= 1.0 for v in out["clairvoyant"])


def test_reuse_keeps_an_earlier_runs_oracle_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """--reuse: cells of an earlier file with the same oracle tokens keep its clairvoyant, found, bound and tight
    windows and draw nothing; ours' rows come from the matrix files again; another oracle size draws afresh."""
    first = run(smoke=True)
    earlier = {**first, "cells": [{**c, "clairvoyant": 0.123, "found": 0.456 if c["found"] is not None else None}
                                  for c in first["cells"]]}

    def no_draw(results: list[dict], oracle_tokens: int = 0) -> list[dict]:
        raise AssertionError(f"drew {[r['cell'] for r in results]}")

    monkeypatch.setattr(eplb_hindsight, "hindsight_spec", no_draw)
    again = run(smoke=True, reuse=earlier)
    assert [c["cell"] for c in again["cells"]] == [c["cell"] for c in first["cells"]]
    for a, e, f in zip(again["cells"], earlier["cells"], first["cells"], strict=True):
        assert (a["clairvoyant"], a["found"], a["bound"], a["tight_windows"]) == (
            e["clairvoyant"], e["found"], e["bound"], e["tight_windows"])
        assert (a["ours"], a["verdict"]) == (f["ours"], f["verdict"])
    monkeypatch.undo()
    fresh = run(smoke=True, reuse={**earlier, "oracle_tokens": 7})  # drawn again: the first run's figures
    assert [c["clairvoyant"] for c in fresh["cells"]] == [c["clairvoyant"] for c in first["cells"]]


def test_a_sample_mix_cell_is_scored_on_its_own_recorded_windows() -> None:
    # sample-mix windows are the sample model's recorded routes (bench/eplb_traces.py), not a synthetic router: the
    # P = E cell's bound and found come from those windows' heat, and there is no clairvoyant forecast to draw
    spec = TraceSpec(family="sample-mix", num_experts=32, num_groups=4, top_k=4, num_layers=4, windows=5)
    n = spec.windows - 1 - FIRST_SCORED
    res = {"cell": "sample-mix/8x2x32", "spec": spec.__dict__, "gpus": 8, "nodes": 2, "slots": 32,
           "policies": {"ours": {"bal_even": [0.0] * n}}}
    out = hindsight_spec([res])[0]
    assert out["clairvoyant"] == [] and len(out["found"]) == n
    routes = load_windows(spec)[0]
    cl = Cluster(8, 2, 32, num_groups=4, node_limit=4)
    h = heat_of(routes[FIRST_SCORED + 1], 32)
    assert out["found"][0] == max(balancedness(even_gpu_load(pl, h, cl)) for pl in fresh_plans(h, cl))
    assert out["bound"][0] == pytest.approx(bound(h, cl.num_gpus))
