"""`r3trace eplb`'s default, `--policy auto`, held out: does the backtest's pick beat the fixed policies it picks from?

Protocol (every cell, every re-plan point t = 1 .. W - 2): the history is the newest HISTORY windows up to t (what the
CLI cuts its training window into: 8 by default, fewer on a short trace). As `r3trace eplb` does (report.make_report):
the backtest scores every policy x forecast on the newest FOLDS history windows in turn, each planned from the
windows before it with the newest REPLAY tokens before it, replaying the scored window's first REPLAY tokens (none
for the sglang-dump family: heat-only, the rule ranks the even split); backtest.choose picks one, which plans fresh on
the whole history. Every candidate also plans fresh on the whole history (ours on ema as the CLI plans it: handed
the windows at the long-run mix of their kinds of token, fitted on each history window's first MIX_TOKENS routes,
token_mix.planning_loads; a point's "load_source" names what that picked) and is scored on window t + 1 by node-limited
replay of its first REPLAY tokens (in every cell: the sglang-dump family's tokens exist, hidden from its planners and
its backtest): the held-out figure of each fixed choice (`--policy X --forecast Y`) beside auto's pick, and the one
that was best in hindsight.
A plan is fresh (no `--previous`), so ours here differs from the matrix's ours, which re-plans from its last plan.

The JSON keeps every point's per-fold backtest balancedness and nodes per token and every candidate's held-out
figures, so another pick rule is scored from the file without planning again (`rules` below).

With --dispatch static (or dynamic) the backtest ranks, and every held-out figure is, SGLang's static (or dynamic,
in expectation) dispatch replayed, as `r3trace eplb --dispatch` does.

Run: .venv/bin/python -m bench.eplb_auto [--seed N] [--dispatch D] [--out FILE]   (16 cells, ~15 min on one core;
     --sweep sample-mix: the sample model's router on a serving stream, 8 cells, ~8 min;
     --smoke: one cell; --reuse FILE --nodes 2: run only the 2-node cells again, copy the others from FILE;
     --cell NAME: that cell again (repeatable), the others from --reuse, or left out without it)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from bench.eplb_matrix import MAIN_SHAPES, SAMPLE_SHAPES, SAMPLE_WINDOWS, Cell
from bench.eplb_matrix import cells as matrix_cells
from bench.eplb_ours_loads import ours_loads, windows_of
from bench.eplb_traces import Family, TraceSpec
from r3trace.eplb.backtest import TIE, Candidate, backtest, choose, fold_windows, rank
from r3trace.eplb.evaluate import FORECASTS, POLICIES, DispatchName, Score, plan_policy, score_placement
from r3trace.eplb.placement import PlacementError
from r3trace.eplb.plan_request import PlanRequest
from r3trace.eplb.score import heat_of

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "eplb-auto.json"
# what `r3trace eplb` does by default: the history windows it cuts its training window into, the tokens it replays a
# scored window, each history window's first tokens the token mix is fitted on (token_mix.py)
HISTORY, REPLAY, MIX_TOKENS = PlanRequest.windows, PlanRequest.replay_tokens, PlanRequest.mix_tokens
WINDOWS = 12  # windows a synthetic cell runs: re-plans at 2 .. 8 history windows, then four at 8
DEFAULT = "ours/ema"  # what auto falls back to without a backtest (report._backtest)
# the synthetic traces: (family, drift, Zipf skew)
TRACES: list[tuple[Family, Literal["slow", "fast"], float]] = [
    ("grouped", "slow", 0.6), ("grouped", "fast", 1.2), ("clustered", "fast", 0.6), ("sglang-dump", "fast", 0.6)]


def cells(smoke: bool, seed: int = 0, sweep: str = "main") -> list[Cell]:
    """The synthetic cells of trace seed `seed`, then the sample model's (one trace: the same every seed); sweep
    "sample-mix": the sample model's router on a serving stream (bench/eplb_traces.py) instead, slow and fast drift
    on the sample's four shapes."""
    base = TraceSpec(windows=WINDOWS, seed=seed)
    if sweep == "sample-mix":
        return matrix_cells("sample-mix", base)
    if smoke:
        spec = replace(base, num_layers=2, windows=5, window_tokens=512)
        return [Cell(replace(spec, family="clustered", drift="fast"), 16, 2, 288)]
    synth = [Cell(replace(base, family=f, drift=d, zipf_s=s), g, n, p) for (f, d, s) in TRACES
             for (g, n, p) in MAIN_SHAPES]
    sample = replace(base, family="sample", num_experts=32, num_groups=4, top_k=4, num_layers=4,
                     windows=SAMPLE_WINDOWS)
    return synth + [Cell(sample, g, n, p) for (g, n, p) in SAMPLE_SHAPES]


def _newest(routes: np.ndarray, upto: int) -> np.ndarray:
    """The newest REPLAY tokens of windows [0, upto) -> [T, L, K] (report: span_sample(newest=True))."""
    flat = routes[:upto].reshape(-1, *routes.shape[2:])
    return flat[-REPLAY:]


# the held-out figure each dispatcher is judged by (evaluate.DISPATCHES): node-limited replay, SGLang's static and
# dynamic dispatch replayed
FIGURE: dict[str, str] = {"node-limited": "replay", "static": "static", "dynamic": "dynamic"}


def _figures(s: Score) -> dict[str, float | None]:
    return {"even": s.balancedness_even, "replay": s.balancedness_replay, "static": s.balancedness_static,
            "dynamic": s.balancedness_dynamic, "nodes": s.nodes_mean}


def run_cell(cell: Cell, dispatch: DispatchName = "node-limited") -> dict[str, Any]:
    t0 = time.perf_counter()
    routes, sees = windows_of(cell.spec)
    heats = np.stack([heat_of(w, cell.spec.num_experts) for w in routes])
    cl = cell.cluster
    points = []
    for t in range(1, len(routes) - 1):
        lo = max(0, t + 1 - HISTORY)
        hist, win = heats[lo:t + 1], routes[lo:t + 1]
        held = fold_windows(len(hist))
        fit = [_newest(win, f) if sees else None for f in held]
        val = [win[f][:REPLAY] if sees else None for f in held]
        cands = backtest(hist, held, fit, val, cl, dispatch=dispatch)
        chosen = choose(cands)
        toks = _newest(win, len(win)) if sees else None
        # what `r3trace eplb` hands ours on ema (report.make_report, loads.window_routes): each history window's
        # first MIX_TOKENS routes fit the token mix; fitted once a trace and span for the cells sharing the trace
        src = ours_loads(cell.spec, lo, t + 1, tokens=MIX_TOKENS) if sees else None
        mixed, demixed = (None, None) if src is None else (src.mixed, src.demixed)  # ours on ema only (plan_policy)
        after: dict[str, dict[str, float | None]] = {}
        for policy in POLICIES:
            for how in FORECASTS:
                try:
                    pl = plan_policy(policy, hist, how, cl, toks, dispatch=dispatch, mixed=mixed, demixed=demixed)
                except PlacementError:
                    continue
                after[f"{policy}/{how}"] = _figures(score_placement(pl, heats[t + 1], routes[t + 1][:REPLAY], cl))
        points.append({"t": t, "history": len(hist), "chosen": f"{chosen.policy}/{chosen.forecast}",
                       "load_source": None if src is None else src.name,
                       "backtest": {f"{c.policy}/{c.forecast}": {"folds": c.fold_balancedness.tolist(),
                                                                 "nodes": [f.nodes_mean for f in c.folds]}
                                    for c in cands if c.folds},
                       "held": after})
        # the pick rebuilt from what the file keeps must be the pick: rules scored from the file are auto's
        assert rule_auto(points[-1]) == points[-1]["chosen"], (cell.name(), t)
    return {"cell": cell.name(), "spec": asdict(cell.spec), "gpus": cell.gpus, "nodes": cell.nodes,
            "slots": cell.slots, "points": points, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------- pick rules, scored from the file
Rule = Callable[[dict[str, Any]], str]


def _cands(point: dict[str, Any]) -> list[Candidate]:
    """The point's backtest as Candidates whose one-number folds carry what the rules read: the ranked
    balancedness and the nodes per token of each fold."""
    out = []
    for name, b in point["backtest"].items():
        policy, how = name.split("/")
        folds = tuple(Score(0, np.array([f]), None, None if n is None else np.array([n]), None)
                      for f, n in zip(b["folds"], b["nodes"], strict=True))
        out.append(Candidate(policy, how, folds))  # type: ignore[arg-type]
    return out


def rule_auto(point: dict[str, Any]) -> str:
    """What `--policy auto` picks (backtest.choose)."""
    c = choose(_cands(point))
    return f"{c.policy}/{c.forecast}"


def rule_rank_all(point: dict[str, Any]) -> str:
    """The rule before the incumbent: every candidate ranked as an equal (best mean; tied within max(TIE, the standard
    error of the per-fold gap); fewest nodes per token; table order)."""
    c = rank(_cands(point))
    return f"{c.policy}/{c.forecast}"


def fixed(name: str) -> Rule:
    return lambda point: name


RULES: dict[str, Rule] = {"auto": rule_auto, "rank all (not shipped)": rule_rank_all,
                          "ours + ema": fixed("ours/ema"), "global + mean": fixed("global/mean"),
                          "global + newest": fixed("global/newest")}


def _se(v: np.ndarray) -> float:
    return float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0


def score_rules(results: Sequence[dict[str, Any]], rules: dict[str, Rule] = RULES,
                dispatch: DispatchName = "node-limited") -> dict[str, Any]:
    """Per rule: its pick's held-out balancedness (under `dispatch`, FIGURE; the even split where a point has no
    tokens) minus
    ours + ema's and minus the best candidate's in hindsight, nodes per token minus ours + ema's, over every point
    (mean, standard error) and by history length; how often it picked ours; cells whose mean is behind ours + ema's
    by more than two standard errors, and ahead by as much."""
    out: dict[str, Any] = {}
    for rname, rule in rules.items():
        rows = []  # (history, cell, vs ours, vs best, nodes vs ours, picked ours)
        for ci, res in enumerate(results):
            for p in res["points"]:
                held = p["held"]
                m = FIGURE[dispatch] if held[DEFAULT][FIGURE[dispatch]] is not None else "even"
                pick = rule(p)
                best = max(v[m] for v in held.values())
                nodes = held[pick]["nodes"]
                rows.append((p["history"], ci, held[pick][m] - held[DEFAULT][m], held[pick][m] - best,
                             np.nan if nodes is None else nodes - held[DEFAULT]["nodes"], pick.startswith("ours")))
        arr = np.array(rows, dtype=float)
        cells_vs = [arr[arr[:, 1] == ci, 2] for ci in range(len(results))]
        out[rname] = {
            "vs_ours": [float(arr[:, 2].mean()), _se(arr[:, 2])], "vs_best": float(arr[:, 3].mean()),
            "nodes_vs_ours": float(np.nanmean(arr[:, 4])) if not np.isnan(arr[:, 4]).all() else None,
            "ours_share": float(arr[:, 5].mean()), "points": len(arr),
            "cells_behind": int(sum(v.mean() < -2 * _se(v) for v in cells_vs)),
            "cells_ahead": int(sum(v.mean() > 2 * _se(v) for v in cells_vs)),
            "by_history": {int(h): [float(arr[arr[:, 0] == h, 2].mean()), _se(arr[arr[:, 0] == h, 2])]
                           for h in np.unique(arr[:, 0])},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one small cell, nothing written")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0, help="the synthetic traces' seed (bench/eplb_traces.TraceSpec)")
    ap.add_argument("--sweep", choices=("main", "sample-mix"), default="main",
                    help="the cells: the 16 of the module doc, or the sample model's router on a serving stream")
    ap.add_argument("--dispatch", choices=tuple(FIGURE), default="node-limited",
                    help="what the backtest ranks and the held-out figures judge by (`r3trace eplb --dispatch`)")
    ap.add_argument("--reuse", type=Path, default=None,
                    help="an earlier results JSON of the same seed and dispatch: its cells are copied, except those "
                         "with --nodes, which run again (a planner change that only reaches those node counts)")
    ap.add_argument("--nodes", type=int, nargs="*", default=[], help="with --reuse: the node counts to run again")
    ap.add_argument("--cell", action="append", default=[],
                    help="a cell to run again, by its name (repeatable; runs cells apart in parallel): the others "
                         "are copied from --reuse, or left out without it")
    args = ap.parse_args()
    earlier = {}
    if args.reuse:
        doc = json.loads(args.reuse.read_text())
        if doc.get("dispatch", "node-limited") != args.dispatch:
            ap.error(f"--reuse {args.reuse}: judged by {doc.get('dispatch', 'node-limited')}, not {args.dispatch}")
        earlier = {r["cell"]: r for r in doc["results"]}
    results = []
    for cell in cells(args.smoke, args.seed, args.sweep):
        if args.cell and cell.name() not in args.cell and cell.name() not in earlier:
            continue
        if cell.name() in earlier and cell.nodes not in args.nodes and cell.name() not in args.cell:
            results.append(earlier[cell.name()])
            continue
        res = run_cell(cell, args.dispatch)
        results.append(res)
        print(f"{res['cell']}: {len(res['points'])} points, {res['seconds']:.0f} s", flush=True)
    scored = score_rules(results, dispatch=args.dispatch)
    for rname, v in scored.items():
        hist = ", ".join(f"{h}: {m:+.4f}" for h, (m, _) in v["by_history"].items())
        print(f"{rname}: vs ours + ema {v['vs_ours'][0]:+.4f} +- {v['vs_ours'][1]:.4f} (by history windows {hist}); "
              f"vs the best in hindsight {v['vs_best']:+.4f}; picked ours {v['ours_share']:.0%}; cells behind / ahead "
              f"of ours + ema beyond 2 SE {v['cells_behind']} / {v['cells_ahead']} of {len(results)}")
    if not args.smoke:
        args.out.write_text(json.dumps({"tie": TIE, "history": HISTORY, "replay": REPLAY, "dispatch": args.dispatch,
                                        "results": results, "rules": scored}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
