"""Ours inside vLLM and SGLang, beside each server's own EPLB algorithm, both called as the server calls them.

vLLM (EplbState.rearrange, vLLM 0.33.0): at each rearrangement the policy class in EPLB_POLICIES["default"] gets the
loads [L, E] summed over the load window (int32, CPU) and the phy2log in service, and returns the next phy2log; ours
is whatever vLLM's plugin loader put there with R3TRACE_VLLM_EPLB=1 (r3trace/eplb/vllm_policy.py), the baseline
vLLM's DefaultEplbPolicy. SGLang (ExpertLocationMetadata.init_by_eplb, SGLang 0.5.23): each rebalance calls
eplb_algorithms.rebalance_experts with the recorder's counts [S, L, E] and the algorithm `--eplb-algorithm auto`
picks (deepseek_hierarchical where the 8 groups divide over the nodes, else deepseek); ours is SGLang's own function
after its plugin loader applied r3trace's hook with R3TRACE_SGLANG_EPLB=1 (r3trace/eplb/sglang_plugin.py), the
baseline the function as the wheel defines it. So each run also checks that wiring.

Here window t's loads plan and window t + 1 scores: even-split balancedness held out (r3trace/eplb/score.py), churn
(the share of slots whose expert changed: each one a weight transfer) and the call's seconds. Ours keeps the windows
(and, under SGLang, its last plan) of its earlier calls; each cell starts it afresh, as a fresh server process. Each
cell: 12 windows of 4,096 tokens from a 16-layer, 256-expert, top-8, 8-group router of bench/eplb_traces.py; 10
held-out re-plans a policy.

Run:   .venv/bin/python -m bench.eplb_servers --vllm-site DIR --deps DEPS [--latest]
       .venv/bin/python -m bench.eplb_servers --sglang-site DIR --deps DEPS [--latest]
Smoke: .venv/bin/python -m bench.eplb_servers --smoke   (no server: ours on both sides of one small cell, the loop only)
DIR holds the server's wheel unpacked (`unzip vllm-0.33.0-*.whl 'vllm/*'`, `unzip sglang-0.5.23-*.whl 'sglang/*'`),
DEPS the modules its EPLB package imports (`pip install --no-deps --target DEPS ...`: the names its ImportErrors give,
psutil, pyzmq, aiohttp and a few more), since neither server is a dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_traces import TraceSpec, load_windows
from bench.result_file import machine
from r3trace.eplb import Cluster, churn, from_phy2log
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of
from r3trace.eplb.vllm_policy import rebalance_phy2log

# (GPUs, nodes, slots): 1, 2, 4 and 8 nodes of 8 GPUs with 32-64 redundant slots per 256 experts
SHAPES = [(8, 1, 288), (16, 2, 288), (32, 4, 288), (64, 8, 320)]
TRACES = [TraceSpec(family="grouped", drift="slow", num_layers=16, windows=12),
          TraceSpec(family="independent", zipf_s=1.2, drift="fast", num_layers=16, windows=12)]
RESULTS = Path(__file__).resolve().parent / "results"
# a server's call: (loads [L, E] int32, slots, groups, nodes, GPUs, phy2log in service or None) -> phy2log [L, P]
Call = Callable[[Any, int, int, int, int, Any], Any]


def on_path(site: str, deps: str | None) -> None:
    """The server's unpacked wheel first on sys.path; deps last, so this environment's torch and numpy stay; the
    repository's root after them: its kernels/ folder would shadow Hugging Face's `kernels` package, which
    transformers (imported by vLLM) imports (`python -m` and PYTHONPATH=. put the root first)."""
    root = Path(__file__).resolve().parents[1]
    here = [p for p in sys.path if Path(p or ".").resolve() == root]
    sys.path[:] = [site, *(p for p in sys.path if p not in here), *([deps] if deps else []), str(root)]


def vllm_calls(site: str, deps: str | None) -> tuple[Call, Call, Callable[[], None], str]:
    """(vLLM's DefaultEplbPolicy, what its plugin loader registered as "default", ours' reset, vLLM's version)."""
    on_path(site, deps)
    os.environ["R3TRACE_VLLM_EPLB"] = "1"
    from vllm import plugins  # type: ignore[import-not-found]
    from vllm._version import __version__  # type: ignore[import-not-found]
    from vllm.distributed.eplb import policy  # type: ignore[import-not-found]

    builtin = policy.EPLB_POLICIES["default"]
    plugins.load_general_plugins()
    ours = policy.EPLB_POLICIES["default"]
    if ours is builtin:
        raise RuntimeError("vLLM's plugin loader did not register r3trace's policy: is r3trace installed (pip -e .)?")
    return builtin.rebalance_experts, ours.rebalance_experts, ours.history.clear, __version__


def sglang_calls(site: str, deps: str | None) -> tuple[Call, Call, Callable[[], None], str]:
    """(SGLang's rebalance_experts as the wheel defines it, the same after its plugin loader applied r3trace's hook,
    ours' reset, SGLang's version), each called as init_by_eplb calls it (counts [S, L, E], `auto` algorithm)."""
    on_path(site, deps)
    os.environ["R3TRACE_SGLANG_EPLB"] = "1"
    from sglang.srt.eplb import eplb_algorithms  # type: ignore[import-not-found]
    from sglang.srt.plugins import load_plugins  # type: ignore[import-not-found]
    from sglang.srt.plugins.hook_registry import HookRegistry  # type: ignore[import-not-found]
    from sglang.version import __version__  # type: ignore[import-not-found]

    from r3trace.eplb.sglang_plugin import TARGET, SglangHook

    builtin = [eplb_algorithms.rebalance_experts]  # in a list: the registry rebinds module attributes holding it
    load_plugins()
    hooked = eplb_algorithms.rebalance_experts
    hooks = [h for _, h, _ in HookRegistry._hooks[TARGET] if isinstance(h, SglangHook)]
    if hooked is builtin[0] or len(hooks) != 1:
        raise RuntimeError("SGLang's plugin loader did not hook r3trace's planner: is r3trace installed (pip -e .)?")

    def call(fn: Callable[..., Any]) -> Call:
        def planned(w: Any, slots: int, groups: int, nodes: int, gpus: int, old: Any) -> Any:
            return fn(tokens_per_expert=w.unsqueeze(0), num_physical_experts=slots,
                      num_local_physical_experts=slots // gpus, num_groups=groups, num_nodes=nodes,
                      algorithm=eplb_algorithms.compute_algorithm("auto", groups, nodes))[0]
        return planned

    return call(builtin[0]), call(hooked), hooks[0].clear, __version__


def run(call: Call, spec: TraceSpec, shape: tuple[int, int, int]) -> dict[str, list[float]]:
    """Per held-out re-plan: balancedness on the next window, churn against the map in service, seconds."""
    import torch

    gpus, nodes, slots = shape
    e = spec.num_experts
    heats = np.stack([heat_of(w, e) for w in load_windows(spec)[0]])
    cl = Cluster(gpus, nodes, slots, num_groups=spec.num_groups)
    old = None
    rows: dict[str, list[float]] = {"bal": [], "churn": [], "seconds": []}
    for t in range(len(heats) - 1):
        weight = torch.from_numpy(heats[t].astype(np.int32))
        t0 = time.perf_counter()
        new = call(weight, slots, spec.num_groups, nodes, gpus, old).cpu()
        took = time.perf_counter() - t0
        pl = from_phy2log(new.numpy(), e)
        if old is not None:
            rows["bal"].append(balancedness(even_gpu_load(pl, heats[t + 1], cl)))
            rows["churn"].append(churn(from_phy2log(old.numpy(), e), pl))
            rows["seconds"].append(took)
        old = new
    return rows


def cell_row(spec: TraceSpec, shape: tuple[int, int, int], res: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    v, o = res["server"], res["ours"]
    diff = np.subtract(o["bal"], v["bal"])
    return {"cell": f"{spec.family}/s={spec.zipf_s}/{spec.drift}/{shape[0]}x{shape[1]}x{shape[2]}",
            "bal_server": float(np.mean(v["bal"])), "bal_ours": float(np.mean(o["bal"])),
            "diff": float(diff.mean()), "se": float(diff.std(ddof=1) / np.sqrt(len(diff))),
            "churn_server": statistics.median(v["churn"]), "churn_ours": statistics.median(o["churn"]),
            "s_server": statistics.median(v["seconds"]), "s_ours": statistics.median(o["seconds"]),
            "ratio": statistics.median(o["seconds"]) / statistics.median(v["seconds"])}


def claim(server: str, out: dict[str, Any]) -> dict[str, Any]:
    """BENCHMARKS.md's table for this run (bench/tables.py's claim format)."""
    name = {"vllm": "vLLM", "sglang": "SGLang"}[server]
    fmt = {"bal_server": "{:.3f}", "bal_ours": "{:.3f}", "diff": "{:+.3f}", "se": "{:.3f}", "churn_server": "{:.0%}",
           "churn_ours": "{:.1%}", "s_server": "{:.3f}", "s_ours": "{:.3f}", "ratio": "{:.2f}x"}
    heads = {"cell": "cell (family / skew / drift / GPUs x nodes x slots)", "bal_server": f"{name}'s own, bal.",
             "bal_ours": "ours, bal.", "diff": f"ours - {name}", "se": "paired SE",
             "churn_server": f"slots moved a re-plan, {name} (median)", "churn_ours": "ours",
             "s_server": f"plan s, {name}", "s_ours": "plan s, ours", "ratio": f"ours / {name}"}
    baseline = {"vllm": f"vLLM {out['version']}'s DefaultEplbPolicy (its wheel's own code), called as "
                        "EplbState.rearrange calls it; ours is what vLLM's plugin loader registered with "
                        "R3TRACE_VLLM_EPLB=1",
                "sglang": f"SGLang {out['version']}'s eplb_algorithms.rebalance_experts (its wheel's own code, "
                          "`--eplb-algorithm auto`), called as init_by_eplb calls it; ours is that function after "
                          "SGLang's plugin loader applied r3trace's hook with R3TRACE_SGLANG_EPLB=1"}[server]
    return {"id": f"eplb-inside-{server}", "hardware": "cpu-2core",
            "shapes": "each cell: 12 windows of 4,096 tokens from a 16-layer, 256-expert, top-8, 8-group router "
                      "(bench/eplb_traces.py); each policy plans on window t's loads with the map in service and is "
                      "scored on window t + 1, 10 held-out re-plans; balancedness = mean over layers of mean / max "
                      "GPU load, the even split of each expert's load over its replicas",
            "baseline": baseline + ", in the same run",
            "command": f"python -m bench.eplb_servers --{server}-site DIR --deps DEPS --latest",
            "sources": [f"bench/results/eplb-servers-{server}.json"],
            "columns": [[k, heads[k], fmt.get(k, "{}")] for k in heads],
            "rows": out["cells"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-site", help="a folder holding vLLM's wheel unpacked")
    ap.add_argument("--sglang-site", help="a folder holding SGLang's wheel unpacked")
    ap.add_argument("--deps", help="a folder of the modules the server's EPLB package imports (last on sys.path)")
    ap.add_argument("--latest", action="store_true", help="also write the claim into bench/results/latest.json")
    ap.add_argument("--smoke", action="store_true", help="no server: ours on both sides of one small cell")
    args = ap.parse_args()
    if args.smoke:
        cell = TraceSpec(num_layers=2, windows=4, window_tokens=512, num_experts=64)
        ours: Call = rebalance_phy2log  # type: ignore[assignment]
        row = cell_row(cell, (8, 2, 72), {k: run(ours, cell, (8, 2, 72)) for k in ("server", "ours")})
        print(json.dumps(row))
        assert row["diff"] == 0.0 and row["churn_ours"] <= 0.5, row
        return
    if bool(args.vllm_site) == bool(args.sglang_site):
        ap.error("give one of --vllm-site and --sglang-site (or --smoke)")
    server = "vllm" if args.vllm_site else "sglang"
    calls = vllm_calls if server == "vllm" else sglang_calls
    builtin, hooked, reset, version = calls(args.vllm_site or args.sglang_site, args.deps)
    cells = []
    for spec in TRACES:
        for shape in SHAPES:
            res = {"server": run(builtin, spec, shape)}
            reset()
            res["ours"] = run(hooked, spec, shape)
            cells.append(cell_row(spec, shape, res))
            print(json.dumps(cells[-1]), flush=True)
    out = {"server": server, "version": version, "machine": machine(), "cells": cells}
    (RESULTS / f"eplb-servers-{server}.json").write_text(json.dumps(out, indent=1) + "\n")
    if args.latest:
        from bench.tables import LATEST

        latest = json.loads(LATEST.read_text())
        cid = f"eplb-inside-{server}"
        keep = [c for c in latest["claims"] if c["id"] not in (cid, "eplb-vllm-policy")]
        latest["claims"] = keep + [claim(server, out)]
        LATEST.write_text(json.dumps(latest, indent=1) + "\n")


if __name__ == "__main__":
    main()
