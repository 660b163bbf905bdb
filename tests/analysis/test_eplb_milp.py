"""The exact placement MILP (bench/eplb_milp.py, scipy's HiGHS) bounds every heuristic on the same instance.
Run: .venv/bin/pytest tests/analysis/test_eplb_milp.py -q"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from bench.eplb_grace import grace_policy
from bench.eplb_milp import placement_objectives, solve
from r3trace.eplb import Cluster, global_policy, hierarchical, plan
from r3trace.eplb.placement import Placement, check_placement
from tests.analysis.brute_placements import placement_points

CL = Cluster(4, 2, 16, num_groups=4)  # 12 experts, 4 extra slots, 2 GPUs per node


def _instance(seed: int, e: int = 12, k: int = 2, t: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(load [E], tokens [T, K]): Zipf(0.8) choices of K distinct experts per token, loads = their counts."""
    rng = np.random.default_rng(seed)
    pop = 1 / np.arange(1, e + 1) ** 0.8
    tok = np.stack([rng.choice(e, k, replace=False, p=pop / pop.sum()) for _ in range(t)])
    return np.bincount(tok.ravel(), minlength=e).astype(float), tok


def _heuristics(load: np.ndarray, tok: np.ndarray) -> dict[str, Placement]:
    w = load[None]
    return {"ours": plan(w, CL, tokens=tok[:, None]), "global": global_policy(w, CL),
            "hierarchical": hierarchical(w, CL), "grace": grace_policy(w, CL, tok[:, None])}


def test_balance_optimum_is_at_most_every_heuristic_and_at_least_the_mean() -> None:
    load, tok = _instance(3)
    best = solve(load, tok, CL, "balance", max_replicas=3, time_limit=60)
    assert best.optimal
    check_placement(best.placement, CL)
    assert best.max_load >= load.sum() / CL.num_gpus - 1e-9  # no GPU can be below the mean at the max
    mx, _ = placement_objectives(best.placement, load, tok, CL)
    assert mx == pytest.approx(best.max_load)  # the solver's objective is the scorer's even-split max
    for name, pl in _heuristics(load, tok).items():
        assert best.max_load <= placement_objectives(pl, load, tok, CL)[0] + 1e-9, name
    # this instance's optimum: 32 units on 4 GPUs, perfectly balanced (ours 8.5, global 8.33, hierarchical 10)
    assert best.max_load == pytest.approx(8.0)


def test_fewest_nodes_at_a_heuristics_balance_is_at_most_its_nodes() -> None:
    load, tok = _instance(4)
    for name, pl in _heuristics(load, tok).items():
        mx, nodes = placement_objectives(pl, load, tok, CL)
        exact = solve(load, tok, CL, "nodes", max_load_cap=mx, max_replicas=3, time_limit=60)
        assert exact.optimal, name
        assert exact.max_load <= mx + 1e-9 and exact.nodes <= nodes + 1e-9, name
        assert exact.nodes == pytest.approx(exact.bound), name  # proved: the incumbent meets the bound


TINY = Cluster(4, 2, 8, num_groups=1)  # 4 GPUs of 2 slots on 2 nodes; 5 experts, so up to 4 replicas of one


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cuts_keep_the_brute_force_optimum(seed: int) -> None:
    """The grid, VUB, expert and symmetry cuts and the aimed search (bench/eplb_milp_model.py) cut off no
    optimum: balance, and the fewest nodes at the tightest balances, equal brute force over every placement."""
    rng = np.random.default_rng(seed)
    pop = 1 / np.arange(1, 6) ** 1.2
    tok = np.stack([rng.choice(5, 2, replace=False, p=pop / pop.sum()) for _ in range(9)])
    load = np.bincount(tok.ravel(), minlength=5).astype(float)
    pts = placement_points(load, tok)
    best = solve(load, tok, TINY, "balance", max_replicas=4, time_limit=30)
    assert best.optimal and best.max_load == pytest.approx(pts[:, 0].min())
    assert best.bound == pytest.approx(pts[:, 0].min())
    for cap in np.unique(pts[:, 0])[:3]:
        got = solve(load, tok, TINY, "nodes", max_load_cap=float(cap), max_replicas=4, time_limit=30)
        assert got.optimal and got.max_load <= cap + 1e-9
        assert got.nodes == pytest.approx(pts[pts[:, 0] <= cap + 1e-9, 1].min())
        assert got.bound == pytest.approx(got.nodes)


@pytest.mark.parametrize("seed", [0, 1])
def test_fixed_counts_give_the_brute_force_optimum_of_those_counts(seed: int) -> None:
    """counts= (bench/eplb_milp.py --ours-counts): the fewest nodes among placements with exactly these replica
    counts, equal to brute force over them, for the balance optimum's counts and for a worse count vector; the
    whole program's optimum is at most each (a restriction)."""
    rng = np.random.default_rng(seed)
    pop = 1 / np.arange(1, 6) ** 1.2
    tok = np.stack([rng.choice(5, 2, replace=False, p=pop / pop.sum()) for _ in range(9)])
    load = np.bincount(tok.ravel(), minlength=5).astype(float)
    best = solve(load, tok, TINY, "balance", max_replicas=4, time_limit=30)
    cap = best.max_load * 1.5  # room for count vectors other than the optimum's
    whole = solve(load, tok, TINY, "nodes", max_load_cap=cap, max_replicas=4, time_limit=30)
    for counts in (np.bincount(best.placement.phy2log[0], minlength=5), np.array([1, 1, 1, 1, 4])):
        pts = placement_points(load, tok, counts)
        pts = pts[pts[:, 0] <= cap + 1e-9]
        if not len(pts):
            with pytest.raises(RuntimeError):
                solve(load, tok, TINY, "nodes", max_load_cap=cap, max_replicas=4, time_limit=30, counts=counts)
            continue
        got = solve(load, tok, TINY, "nodes", max_load_cap=cap, max_replicas=4, time_limit=30, counts=counts)
        np.testing.assert_array_equal(np.bincount(got.placement.phy2log[0], minlength=5), counts)
        assert got.optimal and got.nodes == pytest.approx(pts[:, 1].min()) and got.max_load <= cap + 1e-9
        assert whole.nodes <= got.nodes + 1e-9
    with pytest.raises(ValueError, match="counts: 9 replicas"):
        solve(load, tok, TINY, "nodes", max_load_cap=cap, counts=np.array([1, 1, 1, 2, 4]))


def test_the_aimed_search_steps_its_bound_up_where_the_mean_is_out_of_reach() -> None:
    """The aimed search starts at max(mean GPU load, hottest load / 4) on the grid of twelfths; brute force:
    loads 9, 1, 1, 1, 1 reach it (3.25: 9 / 4 + 1 on every GPU); 7, 3, 1, 1, 1 are one step above it (3.25 ->
    10 / 3) and 5, 5, 3, 1, 1 three steps (3.75 -> 4.0), so the infeasible caps must move the bound up exactly."""
    tok = np.array([[0, 1]])
    for load, opt, steps in (([9, 1, 1, 1, 1], 3.25, 0), ([7, 3, 1, 1, 1], 10 / 3, 1), ([5, 5, 3, 1, 1], 4.0, 3)):
        w = np.asarray(load, dtype=float)
        assert placement_points(w, tok)[:, 0].min() == pytest.approx(opt)
        assert opt - max(w.sum(), w.max()) / 4 == pytest.approx(steps / 12)
        got = solve(w, tok, TINY, "balance", max_replicas=4, time_limit=30)
        assert got.optimal and got.max_load == pytest.approx(opt) and got.bound == pytest.approx(opt), load


def test_an_incumbent_is_a_cutoff_only() -> None:
    """Ours given as the incumbent changes neither optimum (balance; fewest nodes at ours' max load)."""
    load, tok = _instance(3)
    ours = plan(load[None], CL, tokens=tok[:, None])
    mx, _ = placement_objectives(ours, load, tok, CL)
    for kw in ({"objective": "balance"}, {"objective": "nodes", "max_load_cap": mx}):
        plain = solve(load, tok, CL, max_replicas=3, time_limit=60, **kw)  # type: ignore[arg-type]
        cut = solve(load, tok, CL, max_replicas=3, time_limit=60, incumbent=ours, **kw)  # type: ignore[arg-type]
        assert plain.optimal and cut.optimal
        assert (cut.max_load, cut.nodes)[kw["objective"] == "nodes"] == pytest.approx(
            (plain.max_load, plain.nodes)[kw["objective"] == "nodes"])


def test_the_shared_command_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """bench_args, which bench/eplb_milp.py and bench/eplb_corner.py share: defaults, --smoke, a bad limit."""
    from bench.eplb_milp import bench_args

    def parse(*argv: str) -> argparse.Namespace:
        monkeypatch.setattr("sys.argv", ["prog", *argv])
        return bench_args("doc", "x.json", ["a", "b"], ["a", "b", "c"], 45.0)

    args = parse()
    assert (args.instances, args.time_limit, args.out.endswith("bench/results/x.json")) == (["a", "b"], 45.0, True)
    args = parse("--smoke")
    assert (args.instances, args.time_limit, args.out) == (["synth-e16"], 20.0, "")
    assert parse("--instances", "c", "--time-limit", "7").instances == ["c"]
    for bad in (["--time-limit", "0"], ["--instances", "d"]):
        with pytest.raises(SystemExit):
            parse(*bad)
    assert "--time-limit=0.0 must be > 0 seconds" in capsys.readouterr().err


def test_the_result_says_whose_placement_it_is() -> None:
    """A nodes solve stopped before HiGHS has any placement (1 us) returns the incumbent given to it, says so, and
    gives its gap to the bound (ours 1.0625 over a bound of 1 here); solved, it is HiGHS' own and proven (1.0)."""
    load, tok = _instance(4)
    ours = plan(load[None], CL, tokens=tok[:, None])
    mx, nodes = placement_objectives(ours, load, tok, CL)
    cut = solve(load, tok, CL, "nodes", max_load_cap=mx, max_replicas=3, time_limit=1e-6, incumbent=ours)
    assert (cut.source, cut.status, cut.optimal) == ("incumbent", "time_limit", False)
    np.testing.assert_array_equal(cut.placement.phy2log, ours.phy2log)
    assert cut.nodes == pytest.approx(nodes) and cut.gap == pytest.approx((nodes - cut.bound) / nodes)
    assert cut.summary("milp_nodes_") == {"milp_nodes_source": "incumbent", "milp_nodes_status": "time_limit",
                                          "milp_nodes_gap": cut.gap, "milp_nodes_seconds": cut.seconds}
    done = solve(load, tok, CL, "nodes", max_load_cap=mx, max_replicas=3, time_limit=60, incumbent=ours)
    assert (done.source, done.status, done.optimal, done.gap) == ("highs", "optimal", True, 0.0)


def test_ours_within_one_percent_of_the_proven_optima() -> None:
    """The issue's goal on bench/eplb_milp.py's four instances: ours' max GPU load (planned as that bench plans it)
    within 1% of the balance optimum HiGHS proved there (bench/results/eplb-matrix-milp.json), and its nodes per
    token no more than the row says. The bench once planned ours with SGLang's static-even ladder, which is not the
    MILP's objective: synth-e64 then had 37.0 (+2.8%) against the file's 36.0."""
    import json
    from pathlib import Path

    from bench.eplb_milp import EVEN_SPLIT, instance

    doc = json.loads((Path(__file__).resolve().parents[2] / "bench/results/eplb-matrix-milp.json").read_text())
    rows = [r for r in doc["rows"] if r["policy"] == "ours"]
    assert {r["instance"] for r in rows} == {"synth-e16", "synth-e32", "sample-e32", "synth-e64"}
    for r in rows:
        load, tok, cl = instance(r["instance"])
        mx, nodes = placement_objectives(plan(load[None], cl, tokens=tok[:, None], cfg=EVEN_SPLIT), load, tok, cl)
        assert r["milp_balance_optimal"]
        assert mx <= 1.01 * r["milp_max_load"], r["instance"]
        assert mx == pytest.approx(r["max_load"]) and nodes == pytest.approx(r["nodes"]), r["instance"]
