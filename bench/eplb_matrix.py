"""EPLB matrix: our planner against DeepSeek's policies over cluster shapes and trace families, held out.

Protocol (every cell): W consecutive windows of routed tokens (bench/eplb_traces.py). At the end of window t each
policy plans from the windows seen (ours from its previous placement, with the newest window's tokens unless the
family hides them) and is scored on window t + 1, for t = 1 .. W - 2; the cold start (t = 1) is not scored, so each
number is a mean over W - 3 held-out windows. Scores per window: balancedness (mean over layers of mean / max GPU
load) under the even split of each expert's load over its replicas (EPLB's own model) and under node-limited
dispatch (score.node_limited: fewest nodes covering the token's experts, the work split over the replicas on them)
and under SGLang's static dispatch (r3trace/eplb/static.py: a rank's own replica, else its node's first, else one
spread; token t from rank t mod G), nodes per token (the node-limited cover's size), the share of token-layers above the
node limit of 4, and churn (share of slots whose expert changed from the policy's previous plan). "vs X" columns are
paired differences over the same windows, mean +- standard error.

Policies: global = DeepSeek's global policy on all windows seen (summed heat, what `r3trace eplb` plans on),
global-newest = on the newest window only, hierarchical = DeepSeek's hierarchical (where groups % nodes == 0),
grace = GRACE-MoE's affinity grouping + replication (bench/eplb_grace.py), ours = r3trace.eplb.plan as `r3trace eplb`
calls it: with tokens, forecasting from token_mix.planning_loads' windows at the long-run mix of their kinds of token
where a backtest says that forecasts better (plan(mixed=...); each cell's picks in its results' "load_sources").
DeepSeek's policies are r3trace/eplb/deepseek.py (equal to github.com/deepseek-ai/EPLB eplb.py at d52c72d,
tests/analysis/test_eplb_export.py); --eplb-ref DIR times that file itself (never committed here).

Run: .venv/bin/python bench/eplb_matrix.py --smoke             (seconds; what tests/analysis/test_eplb_matrix.py runs)
     .venv/bin/python bench/eplb_matrix.py --sweep shape          (one part of the full run; see BENCHMARKS.md, EPLB)
     .venv/bin/python -m bench.eplb_matrix --plan-time --eplb-ref DIR   (plan time against DeepSeek's eplb.py in DIR;
                                                                          protocol: bench/eplb_plan_time.py)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_grace import grace_policy
from bench.eplb_matrix_results import METRICS, RESULTS, dominates, table, updated
from bench.eplb_ours_loads import HISTORY, Policy, ours_loads, ours_policy, spans, windows_of
from bench.eplb_plan_time import plan_times
from bench.eplb_traces import TraceSpec
from bench.result_file import machine, write_result
from r3trace.eplb import Cluster, PlannerConfig, churn, global_policy, hierarchical, plan
from r3trace.eplb.evaluate import planner_config
from r3trace.eplb.placement import Placement
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of, node_limited
from r3trace.eplb.static import demand, dispatched_load

# ours as `r3trace eplb` plans it: handed token_mix.planning_loads (with --keep-groups for the early drift test alone,
# plan_forecast.forecasts_from_mix; not the trade-off's one node per expert, a layout no flag asks for)
ON_MIX = ("ours", "ours-static", "ours-dynamic", "ours-keep-groups")
BASELINES = ("global", "global-newest")  # the verdicts' baselines: re-run where a reused row lacks a metric
NODE_LIMIT = 4


@dataclass(frozen=True)
class Cell:
    spec: TraceSpec
    gpus: int
    nodes: int
    slots: int

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.gpus, self.nodes, self.slots, num_groups=self.spec.num_groups, node_limit=NODE_LIMIT)

    def name(self) -> str:
        s = self.spec
        return (f"{s.family}/s={s.zipf_s}/{s.drift}/g{s.num_groups}/"
                f"{self.gpus}x{self.nodes}x{self.slots}")


def policies(cl: Cluster, variants: bool = False) -> dict[str, Policy]:
    """The compared policies; variants adds ours' other layouts (the trade-off sweep): one node per expert, and
    group homes kept whole (PlannerConfig.keep_groups)."""
    static_cfg, dynamic_cfg = planner_config("static"), planner_config("dynamic")
    pols: dict[str, Policy] = {
        "global": lambda h, p, t, m: global_policy(h.sum(0), cl),
        "global-newest": lambda h, p, t, m: global_policy(h[-1], cl),
        "grace": lambda h, p, t, m: grace_policy(h[-1], cl, t),
        "ours": ours_policy(cl),
        # what `r3trace eplb --dispatch static` plans: judged under SGLang's static dispatch (bench/eplb_report.py)
        "ours-static": ours_policy(cl, static_cfg),
        # `--dispatch dynamic`: the same layouts, scored by SGLang's dynamic dispatch's expected loads
        "ours-dynamic": ours_policy(cl, dynamic_cfg),
    }
    if cl.num_groups % cl.num_nodes == 0:
        pols["hierarchical"] = lambda h, p, t, m: hierarchical(h[-1], cl)
    if variants:
        onpe, keep = PlannerConfig(spread_by_affinity=False), PlannerConfig(keep_groups=True)
        pols["ours-one-node-per-expert"] = lambda h, p, t, m: plan(h, cl, p, tokens=t, cfg=onpe)
        pols["ours-keep-groups"] = ours_policy(cl, keep)
    return pols


def run_cell(cell: Cell, history: int = HISTORY, variants: bool = False,
             reuse: dict[str, dict[str, list[float]]] | None = None,
             only: tuple[str, ...] | None = None, mix_cache: Path | None = None,
             extra: Callable[[Cluster], dict[str, Policy]] | None = None) -> dict[str, Any]:
    """One cell -> {cell fields, policies: {name: {metric: [per held-out window]}}, seconds}. reuse: the rows of
    policies other than ours' from an earlier run of this cell (their code unchanged), copied instead of re-run (the
    BASELINES re-run where a metric is missing; other rows keep what they have). only: run these policies alone (and
    the extra ones). mix_cache: ours_loads' folder. extra: more policies for the cell's cluster (ours' variants), run
    after these and handed the de-mixed windows as ours is."""
    t0 = time.perf_counter()
    routes, sees_tokens = windows_of(cell.spec)
    e = cell.spec.num_experts
    heats = np.stack([heat_of(w, e) for w in routes])
    cl = cell.cluster
    out: dict[str, dict[str, list[float]]] = {}
    sources: list[str] = []
    more = {} if extra is None else extra(cl)
    for name, f in {**policies(cl, variants), **more}.items():
        if only is not None and name not in only and name not in more:
            continue
        if reuse is not None and not name.startswith("ours") and (
                name not in BASELINES or all(m in reuse[name] for m in METRICS)):
            out[name] = reuse[name]
            continue
        prev: Placement | None = None
        rows: dict[str, list[float]] = {m: [] for m in METRICS}
        for lo, hi in spans(len(routes), history):  # planned at the end of window t = hi - 1, scored on hi
            t, src = hi - 1, None
            if (name in ON_MIX or name in more) and sees_tokens:  # what `r3trace eplb` hands ours (token_mix.py)
                src = ours_loads(cell.spec, lo, hi, mix_cache)
                if name == "ours" and prev is not None:
                    sources.append(src.name)
            pl = f(heats[lo:hi], prev, routes[t] if sees_tokens else None, src)
            if prev is not None:
                d = node_limited(pl, routes[t + 1], cl)
                rows["bal_even"].append(balancedness(even_gpu_load(pl, heats[t + 1], cl)))
                rows["bal_node_limited"].append(balancedness(d.gpu_load))
                sent = demand(routes[t + 1], e, cl.num_gpus)  # [L, G, E] pairs each rank sends
                rows["bal_static"].append(balancedness(dispatched_load(pl, sent, cl, "static")))
                rows["bal_dynamic"].append(balancedness(dispatched_load(pl, sent, cl, "dynamic")))
                rows["nodes"].append(float(d.nodes.mean()))
                rows["over_limit"].append(float((d.nodes > NODE_LIMIT).mean()))
                rows["churn"].append(churn(prev, pl))
            prev = pl
        out[name] = rows
    return {"cell": cell.name(), "spec": asdict(cell.spec), "gpus": cell.gpus, "nodes": cell.nodes,
            "slots": cell.slots, "policies": out, "load_sources": sources, "seconds": time.perf_counter() - t0}


SHAPES = [(8, 1, 256), (8, 1, 288), (8, 1, 320), (16, 2, 256), (16, 2, 288), (16, 2, 320), (32, 4, 256),
          (32, 4, 288), (32, 4, 320), (64, 8, 256), (64, 8, 320), (128, 16, 256), (144, 18, 288)]
MAIN_SHAPES = [(32, 4, 288), (64, 8, 320), (144, 18, 288)]
# the family x drift sweep: the main three, and one, two and sixteen nodes (the node counts {1, 2, 16} under
# fast drift; slow drift on them is the shape sweep's)
FAMILY_SHAPES = [(8, 1, 288), (16, 2, 288), *MAIN_SHAPES, (128, 16, 256)]
SAMPLE_SHAPES = [(8, 2, 32), (8, 2, 40), (16, 4, 48), (16, 2, 64)]
# windows a synthetic cell runs: 17 held-out re-plans. With 8 (5 held out) a change that should not matter, the cold
# plan's forecast weight 0.35 -> 0 (forecast.DEFAULT_ALPHA), moved the 118 verdicts 75 / 41 / 2 -> 67 / 50 / 1 (48
# cells up, 51 down, mean -0.0002); with 20, 88 / 27 / 3 -> 81 / 33 / 4 (33 up, 53 down, mean -0.0004): the cells
# that still flip are those within ~0.0005 of global (the same layouts at the max-load floor)
WINDOWS = 20
# the sample model's traces hold 9,768 tokens: 8 windows of 1,221 (20 would leave 488 a window)
SAMPLE_WINDOWS = 8


def cells(sweep: str, base: TraceSpec) -> list[Cell]:
    """The cells of one part of the matrix (module doc of BENCHMARKS.md's EPLB section lists them)."""
    if sweep == "smoke":
        spec = replace(base, num_layers=3, windows=5, window_tokens=1024)
        return [Cell(replace(spec, zipf_s=1.0), 64, 8, 320), Cell(spec, 32, 4, 288),
                Cell(replace(spec, family="sample", num_experts=32, num_groups=4, top_k=4), 8, 2, 40)]
    if sweep == "shape":  # every shape x skew, grouped router, slow drift
        return [Cell(replace(base, zipf_s=s), g, n, p) for (g, n, p) in SHAPES for s in (0.3, 0.6, 0.9, 1.2)]
    if sweep == "family":  # co-activation structure x drift, one to eighteen nodes
        return [Cell(replace(base, family=f, drift=d, zipf_s=s), g, n, p)
                for f in ("grouped", "clustered", "independent", "sglang-dump") for d in ("slow", "fast")
                for s in (0.6, 1.2) for (g, n, p) in FAMILY_SHAPES if not (f == "grouped" and d == "slow")]
    if sweep == "groups1":  # a router without groups
        return [Cell(replace(base, family=f, num_groups=1, zipf_s=s), g, n, p)
                for f in ("independent", "clustered") for s in (0.6, 1.2)
                for (g, n, p) in [(16, 2, 288), (32, 4, 288), (64, 8, 320), (128, 16, 256), (144, 18, 288)]]
    if sweep == "tradeoff":  # ours' three layouts against DeepSeek's policies (policies(variants=True))
        return [Cell(replace(base, zipf_s=s), g, n, p) for s in (0.6, 1.2)
                for (g, n, p) in [(16, 2, 288), (32, 4, 288), (64, 8, 320)]]
    if sweep == "sample":  # the sample model's traces: 32 experts, 4 groups, top-4
        spec = replace(base, family="sample", num_experts=32, num_groups=4, top_k=4, num_layers=4,
                       windows=min(base.windows, SAMPLE_WINDOWS))
        return [Cell(spec, g, n, p) for (g, n, p) in SAMPLE_SHAPES]
    if sweep == "sample-mix":  # the sample model's router under a serving stream whose domain mix drifts
        spec = replace(base, family="sample-mix", num_experts=32, num_groups=4, top_k=4, num_layers=4)
        return [Cell(replace(spec, drift=d), g, n, p) for d in ("slow", "fast") for (g, n, p) in SAMPLE_SHAPES]
    raise ValueError(f"sweep={sweep!r}: expected smoke, shape, family, groups1, tradeoff, sample or sample-mix")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="three small cells, seconds on CPU")
    ap.add_argument("--sweep", choices=("shape", "family", "groups1", "tradeoff", "sample", "sample-mix"),
                    default=None)
    ap.add_argument("--nodes", type=int, nargs="*", default=[], help="only cells with these node counts")
    ap.add_argument("--skews", type=float, nargs="*", default=[], help="only cells with these Zipf skews")
    ap.add_argument("--slots", type=int, nargs="*", default=[], help="only cells with these slot counts")
    ap.add_argument("--families", nargs="*", default=[], help="only cells of these trace families")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--windows", type=int, default=WINDOWS, help="windows a cell runs (the sample's: at most 8)")
    ap.add_argument("--window-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/eplb-matrix-<sweep>.json)")
    ap.add_argument("--plan-time", action="store_true", help="time plans at [58, 256] instead of a sweep")
    ap.add_argument("--eplb-ref", default=None, help="folder holding DeepSeek's eplb.py, timed beside ours")
    ap.add_argument("--idle", type=float, default=0.0,
                    help="--plan-time: sleep this many seconds before each timed call instead of a warm call")
    ap.add_argument("--shapes", nargs="*", default=[],
                    help="--plan-time: GxNxP shapes (default: eplb_plan_time.PLAN_TIME_SHAPES)")
    ap.add_argument("--reuse", default=None, help="results JSON of the same cells: copy DeepSeek's and GRACE's rows "
                                                  "from it and re-run ours' policies only (their code unchanged)")
    ap.add_argument("--mix-cache", default=None, help="folder of ours' token-mix fits shared by runs of other files")
    ap.add_argument("--update", default=None, help="results JSON of this sweep and seed: --reuse it for those of its "
                                                   "cells the filters select, keep its other cells as they are, write "
                                                   "it back")
    args = ap.parse_args()
    if args.update:
        args.reuse = args.out = args.update
    if args.plan_time:
        name = "eplb-matrix-plan-time" + ("-idle" if args.idle else "")
        out = Path(args.out) if args.out else RESULTS / f"{name}.json"
        shapes = [tuple(int(v) for v in x.split("x")) for x in args.shapes]
        rows = plan_times(args.eplb_ref, idle_s=args.idle, shapes=shapes or None)  # type: ignore[arg-type]
        out.write_text(json.dumps({"rows": rows}, indent=1))
        return
    sweep = "smoke" if args.smoke else args.sweep
    if sweep is None:
        ap.error("give --smoke, --sweep or --plan-time")
    base = TraceSpec(num_layers=args.layers, windows=args.windows, window_tokens=args.window_tokens, seed=args.seed)
    todo = [c for c in cells(sweep, base) if (not args.nodes or c.nodes in args.nodes)
            and (not args.skews or c.spec.zipf_s in args.skews) and (not args.slots or c.slots in args.slots)
            and (not args.families or c.spec.family in args.families)]
    earlier, source = {}, {}
    if args.reuse:
        source = json.loads(Path(args.reuse).read_text())
        earlier = {r["cell"]: r["policies"] for r in source["results"]}
    if args.update:  # the file's own cells of those the filters select (a sweep's cells may span several files)
        todo = [c for c in todo if c.name() in earlier]
    results = []
    for c in todo:
        res = run_cell(c, variants=sweep == "tradeoff", reuse=earlier[c.name()] if args.reuse else None,
                       mix_cache=Path(args.mix_cache) if args.mix_cache else None)
        res["dominates"] = dominates(res)
        results.append(res)
        print("\n".join(table([res])[2:]), f"\n  {res['seconds']:.1f} s, {res['dominates']}", flush=True)
    doc = {"sweep": sweep, "args": vars(args), "machine": machine(), "results": results}
    if args.update:
        doc = updated(source, doc)
    write_result(doc, args.out, args.smoke, RESULTS / f"eplb-matrix-{sweep}.json")


if __name__ == "__main__":
    main()
