"""`r3trace eplb --keep-groups` (PlannerConfig.keep_groups) against DeepSeek's hierarchical policy, held out, on every
cell of the held-out matrix where that policy exists (the nodes divide the groups, more than one node).

Issue 25 asks for an option that dominates hierarchical's nodes per token while keeping balancedness above
hierarchical's. keep_groups keeps every expert's first replica on its group's home node and swaps only inside nodes,
so a token reaches no more nodes than it picks groups, as under the hierarchical layout; its extra replicas are
spread by co-activation and its GPUs levelled as ours' default layout does; without a spare slot groups share nodes by
their tokens (r3trace/eplb/group_pairing.py), and with tokens each layer takes hierarchical's layout where node-limited
replay of the newest tokens favours it (dispatch_contest.groups_contest). Protocol: bench/eplb_matrix.py's
(each policy plans at the end of window t on the windows seen, ours from its previous placement, and is scored on
window t + 1; 17 held-out windows a synthetic cell, the sample's 5).

Run: .venv/bin/python -m bench.eplb_keep_groups [--seed S] [--out FILE] [--mix-cache DIR]   (78 cells, ~15 min on
     one core with the token-mix fits cached, e.g. bench/eplb_rerun.py's .mixcache)
     .venv/bin/python -m bench.eplb_keep_groups --sweep sample-mix [--seed S] (8 cells, ~1 min)
     .venv/bin/python -m bench.eplb_keep_groups --smoke                   (two cells, seconds)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_matrix import WINDOWS, Cell, cells, run_cell
from bench.eplb_traces import TraceSpec
from bench.result_file import machine, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
POLICIES = ("hierarchical", "ours-keep-groups")
KEEP_ID = "eplb-with-groups-kept"


def keep_cells(base: TraceSpec, sweeps: tuple[str, ...] = ("shape", "family", "sample")) -> list[Cell]:
    """The matrix's cells of `sweeps` on more than one node where the nodes divide the groups (the sample's on trace
    seed 0 only: its traces are one recording, the same on every seed)."""
    out = [c for sweep in sweeps if sweep != "sample" or base.seed == 0 for c in cells(sweep, base)]
    return [c for c in out if c.nodes > 1 and c.spec.num_groups % c.nodes == 0]


def out_file(seed: int, sweep: str = "main") -> Path:
    stem = "eplb-keep-groups" + ("" if sweep == "main" else f"-{sweep}")
    return RESULTS / (f"{stem}.json" if seed == 0 else f"{stem}-seed{seed}.json")


def group_of(cell: dict[str, Any]) -> str:
    """The claim's row a cell counts in: its trace kind and node count."""
    kind = {"sample": "the sample model's traces", "sample-mix": "the sample model's router, serving"}.get(
        cell["spec"]["family"], "synthetic routers")
    return f"{kind}; {cell['nodes']} nodes"


def verdicts(res: dict[str, Any]) -> dict[str, float]:
    """Means over the held-out windows: keep-groups minus hierarchical (balancedness even and node-limited, nodes per
    token) and the share of token-layers over the node limit."""
    k, h = res["policies"]["ours-keep-groups"], res["policies"]["hierarchical"]
    d = {m: float(np.mean(np.asarray(k[m]) - np.asarray(h[m]))) for m in ("bal_even", "bal_node_limited", "nodes")}
    d["over_limit"] = float(np.mean(k["over_limit"]))
    return d


def _signs(d: np.ndarray) -> str:
    """Differences d [cells] -> 'below / level / above' counts: level within 1e-9, where a plan that is hierarchical's
    own layout in every window differs by float rounding alone (2e-17)."""
    return f"{int((d < -1e-9).sum())} / {int((abs(d) <= 1e-9).sum())} / {int((d > 1e-9).sum())}"


def keep_groups_claim(paths: list[Path] | None = None) -> dict[str, Any]:
    """BENCHMARKS.md's table: per node count, how many cells keep-groups wins on each count, pooled over the trace
    seeds with result files (each seed's cell counted once)."""
    paths = paths or [p for sweep in ("main", "sample-mix") for p in (out_file(s, sweep) for s in (0, 1, 2))
                      if p.exists()]
    docs = [json.loads(p.read_text()) for p in paths]
    groups: dict[str, list[dict[str, float]]] = {}
    seen = set()
    for doc in docs:
        for res in doc["results"]:
            if res["spec"]["family"] == "sample" and res["cell"] in seen:
                continue  # one recording: the same cell on every trace seed
            seen.add(res["cell"])
            groups.setdefault(group_of(res), []).append(verdicts(res))
    rows = []
    for name in sorted(groups, key=lambda g: (g.startswith("the sample"), g.split("; ")[0],
                                              int(g.split("; ")[1].split()[0]))):
        v = groups[name]
        col = {m: np.array([x[m] for x in v]) for m in v[0]}
        rows.append({"cells": name, "n": len(v), "nodes_fewer": _signs(col["nodes"]),
                     "even_above": _signs(-col["bal_even"]), "nl_above": _signs(-col["bal_node_limited"]),
                     "nodes_median": float(np.median(col["nodes"])), "nodes_worst": float(col["nodes"].max()),
                     "even_median": float(np.median(col["bal_even"])), "even_worst": float(col["bal_even"].min()),
                     "nl_median": float(np.median(col["bal_node_limited"])),
                     "nl_worst": float(col["bal_node_limited"].min()),
                     "over": float(col["over_limit"].max())})
    seeds = sorted({d["args"]["seed"] for d in docs})
    windows = docs[0]["args"]["windows"]
    return {
        "id": KEEP_ID, "hardware": "cpu-2core",
        "shapes": f"every held-out matrix cell on 2, 4 and 8 nodes (the node counts dividing 8 groups; the sample "
                  f"model's 4 groups: 2 and 4): slots x skew 0.3-1.2 (grouped router, slow drift) and the trace "
                  f"families x drift x skew 0.6 / 1.2 on 16 / 2 / 288, 32 / 4 / 288, 64 / 8 / 320, {windows} "
                  f"windows of 4,096 tokens, 6 layers, E = 256, top-8; the sample model's 8 windows (E = 32, "
                  f"top-4, one recording) and its router on a serving stream (sample-mix: 20 windows of 32 requests "
                  f"of held-out text, slow and fast drift); trace seeds {', '.join(map(str, seeds))} (a cell on each "
                  "seed counted once); planned at the end of window t on the windows seen, scored on window t + 1, "
                  "means over the held-out windows",
        "baseline": "DeepSeek's hierarchical policy (r3trace/eplb/deepseek.py, equal to deepseek-ai/EPLB eplb.py "
                    "d52c72d) on the newest window, as the held-out matrix's hierarchical rows, same windows",
        "command": "python -m bench.eplb_keep_groups [--seed S] [--sweep sample-mix]",
        "sources": [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in paths],
        "columns": [["cells", "cells", "{}"], ["n", "n", "{}"],
                    ["nodes_fewer", "nodes/token below / equal to / above hierarchical's", "{}"],
                    ["even_above", "balancedness (even split) above / level with / below", "{}"],
                    ["nl_above", "balancedness (node-limited replay) above / level with / below", "{}"],
                    ["nodes_median", "nodes/token - hierarchical's, median", "{:+.3f}"],
                    ["nodes_worst", "worst", "{:+.4f}"],
                    ["even_median", "even - hierarchical's, median", "{:+.3f}"], ["even_worst", "worst", "{:+.3f}"],
                    ["nl_median", "node-limited - hierarchical's, median", "{:+.3f}"],
                    ["nl_worst", "worst", "{:+.3f}"], ["over", "token-layers over the node limit, most", "{:.1%}"]],
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", choices=("main", "sample-mix"), default="main",
                    help="the matrix's shape, family and sample cells, or its sample-mix ones")
    ap.add_argument("--smoke", action="store_true", help="two small cells")
    ap.add_argument("--out", default=None)
    ap.add_argument("--mix-cache", default=None, help="folder of ours' token-mix fits (bench/eplb_rerun.py's)")
    args = ap.parse_args()
    base = TraceSpec(windows=WINDOWS, seed=args.seed)
    todo = keep_cells(base, ("sample-mix",) if args.sweep == "sample-mix" else ("shape", "family", "sample"))
    if args.smoke:
        todo = [Cell(replace(c.spec, num_layers=2, windows=5, window_tokens=1024), c.gpus, c.nodes, c.slots)
                for c in (todo[0], todo[-1])]
    results = []
    for c in todo:
        res = run_cell(c, variants=True, only=POLICIES, mix_cache=Path(args.mix_cache) if args.mix_cache else None)
        results.append(res)
        v = verdicts(res)
        print(f"{res['cell']}: nodes {v['nodes']:+.3f}, even {v['bal_even']:+.4f}, node-limited "
              f"{v['bal_node_limited']:+.4f}, over the limit {v['over_limit']:.1%} ({res['seconds']:.1f} s)",
              flush=True)
    doc = {"sweep": "keep-groups", "args": {**vars(args), "windows": base.windows}, "machine": machine(),
           "results": results}
    write_result(doc, args.out, args.smoke, out_file(args.seed, args.sweep))


if __name__ == "__main__":
    main()
