"""The held-out matrix's ties and every cell where each slot holds one expert (P = E), against what a plan could do
with more knowledge than the windows seen: how much room above DeepSeek's global policy there is for a planner to take.

With P = E each GPU holds exactly S = E / G experts, so a lower bound on every placement's max GPU load on the
held-out window's loads (r3trace/eplb/hindsight.py: the mean, two pigeonhole bounds, and for S = 2 the sorted pairing,
which is exact) gives `bound`, the most balancedness any policy reaches there, even one that saw the window.
`found`: the best of DeepSeek's global policy and ours planned fresh on the held-out window's own loads, a placement
that exists, so the hindsight optimum lies in [found, bound]. Where they meet the optimum is known.
With spare slots (replicas) no such bound is computed here: in sample a plan balances nearly anything.

The hindsight optimum also knows the window's sampling noise, its domain mix and the drift's next step, which no
forecast from the past can. `clairvoyant` (synthetic routers) is the forecaster that knows everything the past can
tell: the router of the newest window seen (its drift), with the domains in their long-run shares, from ORACLE_TOKENS
tokens (bench/eplb_traces.oracle_heats); on those loads DeepSeek's global policy and ours planned fresh, the one with
the lower max GPU load there, scored on the next window. Between it and a policy planning on the windows seen lies
that policy's estimation error (finite windows, a forecast that lags the drift); above it, what no plan made before
the window can see coming.

A P = E cell's room above the better global policy is bound - that policy's held-out balancedness: no placement
planned before the window beats that policy by more. Pooled over trace seeds 0-2 (bench/eplb_report.pooled), windows
as the held-out matrix's (bench/eplb_matrix.py), read from its result files.

Run: .venv/bin/python -m bench.eplb_hindsight [--jobs N] [--out FILE]   (the P = E cells and the other pooled ties of
     the matrix's result files, 67 trace specs: ~20 min with --jobs 2 on the 2-core machine; --reuse FILE keeps an
     earlier file's oracle figures and draws only the cells it lacks)
     .venv/bin/python -m bench.eplb_hindsight --smoke        (two cells, one seed, a small oracle: ~15 s)

"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_matrix import Cell
from bench.eplb_report import held_out_docs, matrix_files, pooled, seed_runs, verdict
from bench.eplb_traces import TraceSpec, load_windows, oracle_heats
from bench.result_file import machine, write_result
from r3trace.eplb import Cluster, global_policy, plan
from r3trace.eplb.hindsight import bound
from r3trace.eplb.placement import Placement
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = RESULTS / "eplb-hindsight.json"
HINDSIGHT_ID = "eplb-hindsight-bound"
FIRST_SCORED = 2  # bench/eplb_matrix.run_cell scores the plans made at the end of windows 2 .. W - 2
# the clairvoyant's tokens a window: 8x a window's 4,096, so its loads' sampling noise is a third of the window's
ORACLE_TOKENS = 32768


def hindsight_spec(results: list[dict[str, Any]], oracle_tokens: int = ORACLE_TOKENS) -> list[dict[str, list[float]]]:
    """The cells of one trace spec (one trace seed; their windows and oracle drawn once) -> per cell, per held-out
    window: bound (P = E), found (P = E) and clairvoyant (synthetic routers) (module doc)."""
    spec = TraceSpec(**results[0]["spec"])
    oracle = None
    if spec.family in ("sample", "sample-mix"):  # recorded routes: no router to draw a clairvoyant forecast from
        routes = load_windows(spec)[0]
    else:
        routes, oracle = oracle_heats(spec, oracle_tokens)
    heats = [heat_of(w, spec.num_experts) for w in routes]
    outs = []
    for res in results:
        cl = Cell(spec, res["gpus"], res["nodes"], res["slots"]).cluster
        out: dict[str, list[float]] = {"bound": [], "found": [], "clairvoyant": []}
        for t in range(FIRST_SCORED, len(routes) - 1):
            h = heats[t + 1]
            if is_pe(res):
                out["bound"].append(bound(h, cl.num_gpus))
                out["found"].append(max(balancedness(even_gpu_load(pl, h, cl)) for pl in fresh_plans(h, cl)))
            if oracle is not None:
                o = oracle[t]  # the newest window seen when the plan is made
                pl = min(fresh_plans(o, cl), key=lambda p: float(even_gpu_load(p, o, cl).max(1).sum()))
                out["clairvoyant"].append(balancedness(even_gpu_load(pl, h, cl)))
        n = len(range(FIRST_SCORED, len(routes) - 1))
        if n != len(res["policies"]["ours"]["bal_even"]):
            raise ValueError(f"{res['cell']}: {n} held-out windows, the result file has "
                             f"{len(res['policies']['ours']['bal_even'])}")
        outs.append(out)
    return outs


def fresh_plans(heat: np.ndarray, cl: Cluster) -> tuple[Placement, Placement]:
    """heat [L, E] -> DeepSeek's global policy and ours planned fresh on it."""
    return global_policy(heat, cl), plan(heat[None], cl)


def is_pe(res: dict[str, Any]) -> bool:
    return int(res["slots"]) == int(res["spec"]["num_experts"])


def run(smoke: bool = False, jobs: int = 1, reuse: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every P = E cell and every other pooled tie of the held-out result files, pooled over the trace seeds with
    result files -> {sweep, machine, cells: [{cell, seeds, windows, pooled verdict, ours / global / global-newest,
    clairvoyant, found, bound}]} (means over the held-out windows of every seed; None where not computed).
    reuse: an earlier run's document with the same oracle tokens: its cells' clairvoyant, found, bound and tight
    windows are taken as they are (they depend on the traces alone, not on ours), only cells it lacks are drawn."""
    docs = held_out_docs()
    more = seed_runs(docs)
    every = {r["cell"]: [r, *more.get(r["cell"], [])] for f in matrix_files(0, docs) for r in docs[f]["results"]}
    runs = {name: rs for name, rs in every.items() if is_pe(rs[0]) or verdict(pooled(rs)).startswith("tie")}
    oracle_tokens = ORACLE_TOKENS
    if smoke:  # one 128-GPU cell on one trace seed with a small oracle, and the sample model's (no oracle)
        runs = {name: rs[:1] for name, rs in runs.items()}
        runs = dict([next((n, rs) for n, rs in runs.items() if rs[0]["gpus"] == 128),
                     next((n, rs) for n, rs in runs.items() if rs[0]["spec"]["family"] == "sample"),
                     next((n, rs) for n, rs in runs.items()
                          if not is_pe(rs[0]) and rs[0]["spec"]["family"] != "sample")])
        oracle_tokens = 1024
    kept = {c["cell"]: c for c in (reuse or {}).get("cells", [])
            if (reuse or {}).get("oracle_tokens") == oracle_tokens}
    by_spec: dict[str, list[dict[str, Any]]] = {}
    for name, rs in runs.items():
        if name in kept:
            continue
        for r in rs:
            by_spec.setdefault(json.dumps(r["spec"], sort_keys=True), []).append(r)
    groups = list(by_spec.values())
    with ProcessPoolExecutor(jobs) as pool:
        done = pool.map(partial(hindsight_spec, oracle_tokens=oracle_tokens), groups)
        hind = {(r["cell"], r["spec"]["seed"]): h
                for g, hs in zip(groups, done, strict=True) for r, h in zip(g, hs, strict=True)}
    cells = []
    for name, rs in runs.items():
        hs = [hind[name, r["spec"]["seed"]] for r in rs] if name not in kept else []
        seeds_pooled = pooled(rs)
        pols = seeds_pooled["policies"]

        def mean(key: str, hs: list[dict[str, list[float]]] = hs) -> float | None:
            vals = [v for h in hs for v in h[key]]
            return float(np.mean(vals)) if vals else None

        cells.append({
            "cell": name, "gpus": rs[0]["gpus"], "nodes": rs[0]["nodes"], "slots": rs[0]["slots"],
            "family": rs[0]["spec"]["family"], "seeds": [r["spec"]["seed"] for r in rs],
            "windows": len(pols["ours"]["bal_even"]), "verdict": verdict(seeds_pooled).split(" ")[0],
            **{p: float(np.mean(pols[p]["bal_even"])) for p in ("ours", "global", "global-newest")},
            "clairvoyant": mean("clairvoyant"), "found": mean("found"), "bound": mean("bound"),
            "tight_windows": int(sum(abs(b - f) <= 1e-9
                                     for h in hs for b, f in zip(h["bound"], h["found"], strict=True))),
        })
        if name in kept:
            cells[-1].update({k: kept[name][k] for k in ("clairvoyant", "found", "bound", "tight_windows")})
        c = cells[-1]
        print(f"{name}: ours {c['ours']:.5f} global {c['global']:.5f} newest {c['global-newest']:.5f} clairvoyant "
              f"{c['clairvoyant'] or 0:.5f} found {c['found'] or 0:.5f} bound {c['bound'] or 0:.5f} ({c['verdict']})")
    return {"sweep": "hindsight", "oracle_tokens": oracle_tokens, "machine": machine(), "cells": cells}


def better(c: dict[str, Any]) -> float:
    """The better of DeepSeek global's two forecasts held out (all windows seen, the newest), as the verdicts take."""
    return max(c["global"], c["global-newest"])


def hindsight_claim(path: Path = OUT) -> dict[str, Any]:
    """BENCHMARKS.md's table: every pooled tie (P = E first), then the medians of the other P = E cells."""
    doc = json.loads(path.read_text())
    cells = doc["cells"]

    def row(label: str, cs: list[dict[str, Any]]) -> dict[str, Any]:
        def med(f: Callable[[dict[str, Any]], float], fmt: str, needs: str | None = None) -> str:
            """The median of f over the cells that have `needs` ("-" if none has it), formatted."""
            vals = [f(c) for c in cs if needs is None or c[needs] is not None]
            return fmt.format(float(np.median(vals))) if vals else "-"

        lo, hi = med(lambda c: c["found"], "{:.5f}", "found"), med(lambda c: c["bound"], "{:.5f}", "bound")
        tight = all(c["tight_windows"] == c["windows"] for c in cs)
        counts = Counter(c["verdict"] for c in cs)
        return {"cells": label, "verdict": ", ".join(f"{n} {v}" if len(cs) > 1 else v for v, n in counts.items()),
                "ours": med(lambda c: c["ours"], "{:.5f}"), "better": med(better, "{:.5f}"),
                "clairvoyant": med(lambda c: c["clairvoyant"], "{:.5f}", "clairvoyant"),
                "optimum": "-" if lo == "-" else hi if tight else f"{lo} - {hi}",
                "room_clair": med(lambda c: c["clairvoyant"] - better(c), "{:+.5f}", "clairvoyant"),
                "room_bound": med(lambda c: c["bound"] - better(c), "{:+.5f}", "bound"),
                "room_share": med(lambda c: (c["bound"] - better(c)) / better(c), "{:.1%}", "bound"),
                "ours_better": med(lambda c: c["ours"] - better(c), "{:+.5f}")}

    ties = sorted((c for c in cells if c["verdict"] == "tie"), key=lambda c: c["bound"] is None)
    rest = [c for c in cells if c["verdict"] != "tie"]
    rows = [row(c["cell"], [c]) for c in ties]
    if rest:
        rows.append(row(f"the other {len(rest)} P = E cells, medians", rest))
    seeds = sorted({s for c in cells for s in c["seeds"]})
    return {
        "id": HINDSIGHT_ID, "hardware": "cpu-2core",
        "shapes": f"the held-out matrix's pooled ties and its cells where every slot holds one expert ({len(cells)} "
                  "cells: P = E is 256 slots for 256 experts on 8-128 GPUs, the sample model's 32 on 8 and its "
                  "router's serving stream's, sample-mix, 32 on 8), its windows (20 of 4,096 tokens, 6 layers, top-8; "
                  "the sample's 8; sample-mix: 20 of 4,096, 4 layers, top-4), trace seeds "
                  f"{', '.join(map(str, seeds))} pooled (the sample: one recording); balancedness under the even "
                  f"split, means over the held-out windows; clairvoyant (synthetic routers): {doc['oracle_tokens']:,} "
                  "tokens a window from the newest seen window's router, its domains in equal shares",
        "baseline": "DeepSeek's global policy held out (the better of all windows seen and the newest, from the "
                    "matrix's result files), the same windows",
        "command": "python -m bench.eplb_hindsight --jobs 2",
        "sources": [str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)],
        "columns": [["cells", "cell", "{}"], ["verdict", "pooled verdict", "{}"],
                    ["ours", "ours", "{}"], ["better", "the better global", "{}"],
                    ["clairvoyant", "clairvoyant", "{}"], ["optimum", "hindsight optimum (P = E)", "{}"],
                    ["room_clair", "clairvoyant - the better global", "{}"],
                    ["room_bound", "hindsight bound - the better global", "{}"],
                    ["room_share", "the same, share", "{}"],
                    ["ours_better", "ours - the better global", "{}"]],
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="two cells, nothing written")
    ap.add_argument("--out", default=None)
    ap.add_argument("--jobs", type=int, default=1, help="trace specs drawn in parallel (one process each)")
    ap.add_argument("--reuse", default=None, help="an earlier result file: its cells' oracle figures kept, only the "
                                                  "cells it lacks drawn (ours' rows come from the matrix either way)")
    args = ap.parse_args()
    doc = run(args.smoke, args.jobs, json.loads(Path(args.reuse).read_text()) if args.reuse else None)
    write_result(doc, args.out, args.smoke, OUT)


if __name__ == "__main__":
    main()
