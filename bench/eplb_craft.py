"""A CRAFT-style baseline (arXiv 2603.28768: per-layer replica counts chosen by estimated benefit under a memory
budget) beside ours and DeepSeek's global policy, held out.

CRAFT gives each MoE layer its own number of redundant replicas, chosen where the estimated balancedness gain per
replica is largest, under a total memory budget, and places each layer with DeepSeek's EPLB. Here a layer's
redundancy comes in whole slots a GPU (every GPU of a layer holds as many slots, as EPLB's packing needs), the estimate
is the global policy's in-sample balancedness on the windows seen at each level (CRAFT's layerwise estimate), and the
budget is split exactly over layers by dynamic programming. Scored as the held-out matrix scores (bench/eplb_matrix.py):
each policy plans at the end of window t on the windows seen and is scored on window t + 1, even split, mean over
layers. Two budgets: the uniform cell's redundant slots (the memory global and ours use) and half of them (CRAFT's
claim: as balanced with fewer replicas). Per-layer slot counts do not fit SGLang's or DeepSeek's [layers, slots]
maps, which hold one count for every layer, so neither ours nor any `r3trace eplb` export can take such a plan.

Run: .venv/bin/python -m bench.eplb_craft [--out FILE]   (21 cells, ~4 min on 2 cores; --smoke: one, seconds)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_matrix import WINDOWS, Cell, cells
from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, global_policy
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "eplb-craft.json"
SHAPES = [(32, 4, 288), (32, 4, 320), (64, 8, 320)]  # the matrix's shapes with spare slots on 4 and 8 nodes
MAX_LEVEL = 4  # most extra slots a GPU one layer may take
HISTORY = 8  # windows the policies plan on (bench/eplb_matrix.run_cell's)


def layer_balancedness(w: np.ndarray, cluster: Cluster, level: int, heat: np.ndarray) -> float:
    """DeepSeek global's plan of one layer's loads w [E] with `level` extra slots a GPU, scored on heat [E]."""
    e, g = len(w), cluster.num_gpus
    cl = Cluster(g, cluster.num_nodes, e + level * g, num_groups=cluster.num_groups)
    return balancedness(even_gpu_load(global_policy(w[None], cl), heat[None], cl))


def craft_levels(w: np.ndarray, cluster: Cluster, budget: int) -> np.ndarray:
    """Loads w [L, E], budget in extra slots a GPU summed over layers -> [L] each layer's extra slots a GPU: the split
    of the budget with the highest summed in-sample balancedness of global's plans (exact, over every split)."""
    n_layers = len(w)
    est = np.array([[layer_balancedness(w[layer], cluster, k, w[layer]) for k in range(MAX_LEVEL + 1)]
                    for layer in range(n_layers)])  # [L, K]
    best = np.full(budget + 1, -np.inf)  # best[b]: the highest sum over the layers so far using b units
    best[0] = 0.0
    pick = np.zeros((n_layers, budget + 1), dtype=np.int64)
    for layer in range(n_layers):
        nxt = np.full(budget + 1, -np.inf)
        for b in range(budget + 1):
            for k in range(min(MAX_LEVEL, b) + 1):
                v = best[b - k] + est[layer, k]
                if v > nxt[b]:
                    nxt[b], pick[layer, b] = v, k
        best = nxt
    out = np.zeros(n_layers, dtype=np.int64)
    b = int(np.argmax(best))
    for layer in range(n_layers - 1, -1, -1):
        out[layer] = pick[layer, b]
        b -= out[layer]
    return out


def run_cell(cell: Cell) -> dict[str, Any]:
    """One cell -> per held-out window: global's, CRAFT's at the uniform budget and at half of it (balancedness), and
    the fewest and most extra slots a GPU CRAFT's split at the uniform budget gives a layer."""
    routes, _ = load_windows(cell.spec)
    e = cell.spec.num_experts
    heats = np.stack([heat_of(r, e) for r in routes])
    cl = cell.cluster
    uniform = (cell.slots - e) // cell.gpus  # extra slots a GPU in every layer
    n_layers = heats.shape[1]
    rows: dict[str, list[float]] = {"global": [], "craft": [], "craft_half": [], "craft_low": [], "craft_high": []}
    for t in range(2, len(routes) - 1):  # the matrix's held-out windows: planned at t, scored on t + 1
        w = heats[max(0, t + 1 - HISTORY):t + 1].sum(0)  # global's forecast (bench/eplb_matrix.policies)
        nxt = heats[t + 1]
        rows["global"].append(float(np.mean([layer_balancedness(w[i], cl, uniform, nxt[i])
                                             for i in range(n_layers)])))
        for name, budget in (("craft", uniform * n_layers), ("craft_half", uniform * n_layers // 2)):
            lv = craft_levels(w, cl, budget)
            rows[name].append(float(np.mean([layer_balancedness(w[i], cl, int(lv[i]), nxt[i])
                                             for i in range(n_layers)])))
            if name == "craft":  # how unlike the uniform split: its fewest and most extra slots a GPU a layer
                rows["craft_low"].append(float(lv.min()))
                rows["craft_high"].append(float(lv.max()))
    return {"cell": cell.name(), "uniform_level": uniform, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--windows", type=int, default=WINDOWS)
    ap.add_argument("--smoke", action="store_true", help="one sample cell of 5 windows, nothing written: make test")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    base = TraceSpec(windows=5 if args.smoke else args.windows)
    chosen = [] if args.smoke else [c for c in cells("shape", base) if (c.gpus, c.nodes, c.slots) in SHAPES]
    chosen += [c for c in cells("sample", base) if c.slots > c.spec.num_experts]  # 4 layers, each its own skew
    # the sample model's router serving held-out text, slow and fast drift
    chosen += [] if args.smoke else [c for c in cells("sample-mix", base) if c.slots > c.spec.num_experts]
    chosen = chosen[:1] if args.smoke else chosen
    results = []
    for c in chosen:
        r = run_cell(c)
        results.append(r)
        m = {k: float(np.mean(v)) for k, v in r["rows"].items()}
        print(f"{r['cell']}: global {m['global']:.4f}  craft {m['craft']:.4f}  craft at half the spare slots "
              f"{m['craft_half']:.4f}", flush=True)
    if args.smoke:
        return
    args.out.write_text(json.dumps({"windows": args.windows, "max_level": MAX_LEVEL, "results": results,
                                    "seconds": time.perf_counter() - t0}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
