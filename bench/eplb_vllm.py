"""Ours as vLLM's EPLB policy beside vLLM's built-in DefaultEplbPolicy, both called through vLLM's own registry.

vLLM's loop (EplbState.rearrange, vLLM 0.33.0): at each rearrangement the policy class in EPLB_POLICIES["default"]
gets the loads [L, E] summed over the load window (int32, CPU) and the phy2log in service, and returns the next
phy2log. Here window t's loads plan and window t + 1 scores: even-split balancedness held out (r3trace/eplb/score.py),
churn (the share of slots whose expert changed: each one a weight transfer) and the call's seconds. vLLM's policy is
its own class from the wheel; ours is whatever vLLM's plugin loader put in the registry with R3TRACE_VLLM_EPLB=1
(r3trace/eplb/vllm_policy.py), so the run also checks that wiring; it keeps the windows of its earlier calls (a fresh
process per cell). Each cell: 12 windows of 4,096 tokens from a
16-layer, 256-expert, top-8, 8-group router of bench/eplb_traces.py; 10 held-out re-plans a policy.

Run:   .venv/bin/python -m bench.eplb_vllm --vllm-site DIR --vllm-deps DEPS [--out FILE] [--latest]
Smoke: .venv/bin/python -m bench.eplb_vllm --smoke   (no vLLM: ours on both sides of one small cell, the loop only)
DIR holds vLLM's wheel unpacked (`unzip vllm-0.33.0-*.whl 'vllm/*'`), DEPS the modules its eplb package imports
(`pip install --target DEPS psutil pyzmq cbor2 aiohttp openai-harmony`), since vLLM is not a dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_matrix import machine
from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, churn, from_phy2log
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of
from r3trace.eplb.vllm_policy import rebalance_phy2log

# (GPUs, nodes, slots): 2, 4 and 8 nodes of 8 GPUs with 32-64 redundant slots per 256 experts
SHAPES = [(16, 2, 288), (32, 4, 288), (64, 8, 320)]
TRACES = [TraceSpec(family="grouped", drift="slow", num_layers=16, windows=12),
          TraceSpec(family="independent", zipf_s=1.2, drift="fast", num_layers=16, windows=12)]
RESULT = Path(__file__).resolve().parent / "results" / "eplb-vllm.json"


def vllm_policies(site: str, deps: str | None) -> tuple[type, type, str]:
    """(vLLM's DefaultEplbPolicy, what its plugin loader registered as "default", vLLM's version) from DIR; deps go
    last on sys.path, so this environment's torch and numpy stay the ones imported."""
    sys.path.insert(0, site)
    if deps:
        sys.path.append(deps)
    os.environ["R3TRACE_VLLM_EPLB"] = "1"
    from vllm import plugins  # type: ignore[import-not-found]
    from vllm._version import __version__  # type: ignore[import-not-found]
    from vllm.distributed.eplb import policy  # type: ignore[import-not-found]

    builtin = policy.EPLB_POLICIES["default"]
    plugins.load_general_plugins()
    ours = policy.EPLB_POLICIES["default"]
    if ours is builtin:
        raise RuntimeError("vLLM's plugin loader did not register r3trace's policy: is r3trace installed (pip -e .)?")
    return builtin, ours, __version__


class SmokePolicy:
    """--smoke's stand-in for both sides: ours' function in vLLM 0.33.0's call shape, without vLLM's registry."""

    rebalance_experts = staticmethod(rebalance_phy2log)


def run(policy: Any, spec: TraceSpec, shape: tuple[int, int, int]) -> dict[str, list[float]]:
    """Per held-out re-plan: balancedness on the next window, churn against the map in service, seconds."""
    import torch

    gpus, nodes, slots = shape
    e = spec.num_experts
    heats = np.stack([heat_of(w, e) for w in load_windows(spec)[0]])
    cl = Cluster(gpus, nodes, slots, num_groups=spec.num_groups)
    if hasattr(policy, "history"):  # ours keeps its process's windows (vllm_policy.WindowHistory): a fresh process
        policy.history.clear()
    old = None
    rows: dict[str, list[float]] = {"bal": [], "churn": [], "seconds": []}
    for t in range(len(heats) - 1):
        weight = torch.from_numpy(heats[t].astype(np.int32))
        t0 = time.perf_counter()
        new = policy.rebalance_experts(weight, slots, spec.num_groups, nodes, gpus, old)
        took = time.perf_counter() - t0
        pl = from_phy2log(new.numpy(), e)
        if old is not None:
            rows["bal"].append(balancedness(even_gpu_load(pl, heats[t + 1], cl)))
            rows["churn"].append(churn(from_phy2log(old.numpy(), e), pl))
            rows["seconds"].append(took)
        old = new
    return rows


def cell_row(spec: TraceSpec, shape: tuple[int, int, int], res: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    v, o = res["vllm"], res["ours"]
    diff = np.subtract(o["bal"], v["bal"])
    return {"cell": f"{spec.family}/s={spec.zipf_s}/{spec.drift}/{shape[0]}x{shape[1]}x{shape[2]}",
            "bal_vllm": float(np.mean(v["bal"])), "bal_ours": float(np.mean(o["bal"])),
            "diff": float(diff.mean()), "se": float(diff.std(ddof=1) / np.sqrt(len(diff))),
            "churn_vllm": statistics.median(v["churn"]), "churn_ours": statistics.median(o["churn"]),
            "s_vllm": statistics.median(v["seconds"]), "s_ours": statistics.median(o["seconds"]),
            "ratio": statistics.median(o["seconds"]) / statistics.median(v["seconds"])}


def claim(out: dict[str, Any]) -> dict[str, Any]:
    """BENCHMARKS.md's table for this run (bench/tables.py's claim format)."""
    fmt = {"bal_vllm": "{:.3f}", "bal_ours": "{:.3f}", "diff": "{:+.3f}", "se": "{:.3f}", "churn_vllm": "{:.0%}",
           "churn_ours": "{:.1%}", "s_vllm": "{:.3f}", "s_ours": "{:.3f}", "ratio": "{:.2f}x"}
    heads = {"cell": "cell (family / skew / drift / GPUs x nodes x slots)", "bal_vllm": "vLLM default, bal.",
             "bal_ours": "ours, bal.", "diff": "ours - vLLM", "se": "paired SE",
             "churn_vllm": "slots moved a re-plan, vLLM (median)", "churn_ours": "ours", "s_vllm": "plan s, vLLM",
             "s_ours": "plan s, ours", "ratio": "ours / vLLM"}
    return {"id": "eplb-vllm-policy", "hardware": "cpu-2core",
            "shapes": "each cell: 12 windows of 4,096 tokens from a 16-layer, 256-expert, top-8, 8-group router "
                      "(bench/eplb_traces.py); each policy plans on window t's loads with the map in service and is "
                      "scored on window t + 1, 10 held-out re-plans; balancedness = mean over layers of mean / max "
                      "GPU load, the even split of each expert's load over its replicas",
            "baseline": f"vLLM {out['vllm_version']}'s DefaultEplbPolicy (its wheel's own code) in the same run, "
                        "called as EplbState.rearrange calls it; ours is what vLLM's plugin loader registered with "
                        "R3TRACE_VLLM_EPLB=1",
            "command": "python -m bench.eplb_vllm --vllm-site DIR --latest",
            "sources": ["bench/results/eplb-vllm.json"],
            "columns": [[k, heads[k], fmt.get(k, "{}")] for k in heads],
            "rows": out["cells"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-site", help="a folder holding vLLM's wheel unpacked and its import needs")
    ap.add_argument("--vllm-deps", help="a folder of the modules vLLM's eplb package imports (last on sys.path)")
    ap.add_argument("--out", default=str(RESULT))
    ap.add_argument("--latest", action="store_true", help="also write the claim into bench/results/latest.json")
    ap.add_argument("--smoke", action="store_true", help="no vLLM: ours on both sides of one small cell")
    args = ap.parse_args()
    if args.smoke:
        cell = TraceSpec(num_layers=2, windows=4, window_tokens=512, num_experts=64)
        row = cell_row(cell, (8, 2, 72), {k: run(SmokePolicy, cell, (8, 2, 72)) for k in ("vllm", "ours")})
        print(json.dumps(row))
        assert row["diff"] == 0.0 and row["churn_ours"] <= 0.5, row
        return
    if not args.vllm_site:
        ap.error("--vllm-site is required (or --smoke)")
    builtin, ours, version = vllm_policies(args.vllm_site, args.vllm_deps)
    cells = []
    for spec in TRACES:
        for shape in SHAPES:
            res = {"vllm": run(builtin, spec, shape), "ours": run(ours, spec, shape)}
            cells.append(cell_row(spec, shape, res))
            print(json.dumps(cells[-1]), flush=True)
    out = {"vllm_version": version, "machine": machine(), "cells": cells}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.latest:
        from bench.tables import LATEST

        latest = json.loads(LATEST.read_text())
        latest["claims"] = [c for c in latest["claims"] if c["id"] != "eplb-vllm-policy"] + [claim(out)]
        LATEST.write_text(json.dumps(latest, indent=1) + "\n")


if __name__ == "__main__":
    main()
