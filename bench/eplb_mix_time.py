"""The token mix's fit at DeepSeek-V3's shape: what `r3trace eplb --policy ours` (and auto's ours + ema) spends
fitting the kinds of token before it plans (token_mix.planning_loads; BENCHMARKS.md, EPLB plan time).

Per trace (bench/eplb_traces.py at 58 MoE layers, E = 256, top-8; 8 history windows of 2,048 tokens, the CLI's
--mix-tokens, and the next window held out): planning_loads with the EM on token_mix.EM_LAYERS layers (the
default) and on all 58 (the baseline), in one process, alternating, the median of `rounds` calls each; the source
each picks, the kinds, and its windows' one-window-ahead squared rate error on the held-out window (the least over
forecast.ALPHAS). Beside them, r3trace's numpy DeepSeek global policy on the same history (32 GPUs / 4 nodes / 288
slots) for scale.

Run:   .venv/bin/python -m bench.eplb_mix_time   (~3 min on 2 cores)
Smoke: .venv/bin/python -m bench.eplb_mix_time --smoke   (10 layers, 64 experts, 256 tokens; nothing written)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_traces import TraceSpec, synth_windows
from bench.result_file import machine
from r3trace.eplb import Cluster, global_policy
from r3trace.eplb.forecast import ALPHAS, rates_of, smooth_rates
from r3trace.eplb.plan_request import PlanRequest
from r3trace.eplb.score import heat_of
from r3trace.eplb.token_mix import EM_LAYERS, Source, planning_loads

OUT = Path(__file__).resolve().parent / "results" / "eplb-mix-time.json"
HISTORY, MIX_TOKENS = PlanRequest.windows, PlanRequest.mix_tokens  # `r3trace eplb`'s defaults
TRACES = [("grouped", "fast"), ("grouped", "slow"), ("clustered", "fast"), ("clustered", "slow"),
          ("independent", "fast")]


def held_out_error(src: Source, next_window: np.ndarray) -> float:
    """The least over the EMA weights of the squared rate error of src's windows' forecast of the next raw window."""
    g, r = rates_of(next_window), rates_of(src.loads)
    return min(float(((g - smooth_rates(r, a)) ** 2).sum()) for a in ALPHAS)


def run_trace(spec: TraceSpec, rounds: int) -> dict[str, Any]:
    routes = synth_windows(spec)  # [HISTORY + 1, T, L, K]
    heats = np.stack([heat_of(w, spec.num_experts) for w in routes]).astype(np.float64)
    hist, wins = heats[:HISTORY], list(routes[:HISTORY])
    arms = {"em_subset": EM_LAYERS, "em_all": spec.num_layers}
    times: dict[str, list[float]] = {k: [] for k in arms}
    srcs: dict[str, Source] = {}
    cl = Cluster(32, 4, 288, num_groups=spec.num_groups)
    glob = []
    for i in range(rounds):
        for name in (arms if i % 2 == 0 else reversed(arms)):  # alternate which arm runs first
            t0 = time.perf_counter()
            srcs[name] = planning_loads(hist, wins, em_layers=arms[name])
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        global_policy(hist.sum(0), cl)
        glob.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"trace": f"{spec.family}/{spec.drift}", "layers": spec.num_layers,
                           "global_s": statistics.median(glob)}
    for name in arms:
        s = srcs[name]
        out[name] = {"s": statistics.median(times[name]), "source": s.name,
                     "held_out_error": held_out_error(s, heats[HISTORY])}
    return out


MIX_TIME_ID = "eplb-mix-time"


def mix_time_claim(path: Path = OUT) -> dict[str, Any]:
    """BENCHMARKS.md's table from the result file."""
    doc = json.loads(path.read_text())
    rows = [{"trace": r["trace"], "subset": r["em_subset"]["s"], "all": r["em_all"]["s"],
             "ratio": r["em_subset"]["s"] / r["em_all"]["s"], "global": r["global_s"],
             "sources": f"{r['em_subset']['source']} / {r['em_all']['source']}",
             "error": f"{r['em_subset']['held_out_error']:.5f} / {r['em_all']['held_out_error']:.5f} "
                      f"({r['em_subset']['held_out_error'] / r['em_all']['held_out_error'] - 1:+.1%})"}
            for r in doc["rows"]]
    return {
        "id": MIX_TIME_ID, "hardware": "cpu-2core",
        "shapes": f"58 MoE layers, E = 256, top-8, 8 groups (bench/eplb_traces.py, skew 0.6, trace seed 0): {HISTORY} "
                  f"history windows of {MIX_TOKENS:,} tokens (r3trace eplb's --mix-tokens) and the next one held out; "
                  f"token_mix.planning_loads, medians of {doc['rounds']} calls a side, alternating which runs first",
        "baseline": f"the same fit with its EM on all 58 layers instead of {doc['em_layers']} (token_mix.EM_LAYERS), "
                    "in the same run; r3trace's numpy DeepSeek global policy on the same history (32 / 4 / 288) for "
                    "scale",
        "command": "python -m bench.eplb_mix_time",
        "sources": [str(path.relative_to(path.parents[2]))],
        "columns": [["trace", "router / drift", "{}"], ["subset", f"EM on {doc['em_layers']} layers s", "{:.2f}"],
                    ["all", "EM on 58 s", "{:.2f}"], ["ratio", "ratio", "{:.2f}x"],
                    ["global", "DeepSeek global (numpy) s", "{:.3f}"], ["sources", "source picked", "{}"],
                    ["error", "held-out one-window-ahead error (vs all)", "{}"]],
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="10 layers, 64 experts, 256 tokens, one trace; no file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    base = TraceSpec(zipf_s=0.6, num_layers=58, windows=HISTORY + 1, window_tokens=MIX_TOKENS, seed=0)
    traces = TRACES
    if args.smoke:
        base, traces, args.rounds = replace(base, num_layers=10, num_experts=64, window_tokens=256), TRACES[:1], 1
    rows = []
    for family, drift in traces:
        row = run_trace(replace(base, family=family, drift=drift), args.rounds)  # type: ignore[arg-type]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.smoke:
        args.out.write_text(json.dumps({"rows": rows, "rounds": args.rounds, "em_layers": EM_LAYERS,
                                        "machine": machine()}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
