"""BENCHMARKS.md's EPLB tables as claims of bench/results/latest.json, each computed from its result files: the
held-out matrix (bench/eplb_report.py), plan time and the MILP (bench/eplb_matrix.py --plan-time, bench/eplb_milp.py),
the replica budget (bench/eplb_craft.py), groups kept (bench/eplb_keep_groups.py), the hindsight bound
(bench/eplb_hindsight.py), the default policy (bench/eplb_auto.py), the churn trade-off (bench/eplb_churn_curve.py) and
node copies (bench/eplb_node_copies.py).

Run: .venv/bin/python -m bench.eplb_report --latest   (writes them; then python -m bench.tables rewrites BENCHMARKS.md)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_churn_curve import churn_claim
from bench.eplb_hindsight import hindsight_claim
from bench.eplb_keep_groups import keep_groups_claim
from bench.eplb_matrix_results import RESULTS
from bench.eplb_mix_time import mix_time_claim
from bench.eplb_node_copies import copies_claim
from bench.eplb_report import matrix_claim, matrix_files
from bench.tables import LATEST

PLAN_TIME_ID, MILP_ID = "eplb-plan-time", "eplb-placement-milp"
CRAFT_ID, AUTO_ID = "eplb-replica-budget", "eplb-default-policy"
PLAN_TIME_FILE, MILP_FILE = RESULTS / "eplb-matrix-plan-time.json", RESULTS / "eplb-matrix-milp.json"
CRAFT_FILE = RESULTS / "eplb-craft.json"
# bench/eplb_auto.py on trace seeds 0, 1 and 2
AUTO_FILES = [RESULTS / "eplb-auto.json", RESULTS / "eplb-auto-seed1.json", RESULTS / "eplb-auto-seed2.json",
              RESULTS / "eplb-auto-static.json", RESULTS / "eplb-auto-dynamic.json",
              RESULTS / "eplb-auto-sample-mix.json", RESULTS / "eplb-auto-sample-mix-seed1.json",
              RESULTS / "eplb-auto-sample-mix-seed2.json"]


def plan_time_claim(path: Path = PLAN_TIME_FILE) -> dict[str, Any]:
    out = []
    for r in json.loads(path.read_text())["rows"]:
        gpus, nodes, slots = r["shape"].split("x")
        out.append({"shape": f"{gpus} / {nodes} / {slots}", "fresh": r["ours_fresh"], "replan": r["ours_replan"],
                    "ref_default": r["ref_default"], "ref_global": r["ref_global"],
                    "fresh_ratio": r["ours_fresh"] / r["ref_default"],
                    "replan_ratio": r["ours_replan"] / r["ref_default"],
                    "replan_drift": r["ours_replan_drift"],
                    "replan_drift_ratio": r["ours_replan_drift"] / r["ref_default"],
                    "numpy_global": r["global_numpy"],
                    "static": (f"{r['ours_static_fresh']:.3f} / {r['ours_static_replan']:.3f} "
                               f"({r['ours_static_fresh'] / r['ref_default']:.2f}x / "
                               f"{r['ours_static_replan'] / r['ref_default']:.2f}x)") if "ours_static_fresh" in r
                    else "-",
                    "no_tokens": (f"{r['ours_fresh_no_tokens']:.3f} / {r['ours_replan_drift_no_tokens']:.3f} "
                                  f"({r['ours_fresh_no_tokens'] / r['ref_default']:.2f}x / "
                                  f"{r['ours_replan_drift_no_tokens'] / r['ref_default']:.2f}x)")
                    if "ours_fresh_no_tokens" in r else "-"})  # fmt: skip
    return {
        "id": PLAN_TIME_ID, "hardware": "cpu-2core",
        "shapes": "[58, 256] loads (58 MoE layers, E = 256, 8 groups); medians of 7 rounds, each calling ours and "
                  "the reference in turn, in reverse order every other round, every timed call (both sides) right "
                  "after an untimed call of the same function; the CPU shared with other jobs; "
                  "a re-plan starts from ours' previous placement with the newest 2,048 tokens; a drifting re-plan "
                  "from 4 windows of fast drift (sigma 0.3 logits a window) to 5, the backtest calling drift "
                  "(without tokens from 5 to 6: on 3 scored windows the call would not hold, PlannerConfig.drift_t)",
        "baseline": "DeepSeek's eplb.py (deepseek-ai/EPLB d52c72d, never committed) in the same process: "
                    "`rebalance_experts` with 8 groups and the shape's nodes (default: hierarchical where the nodes "
                    "divide the groups) and with one group and one node (global)",
        "command": "python -m bench.eplb_matrix --plan-time --eplb-ref DIR",
        "sources": [str(path.relative_to(RESULTS.parents[1]))],
        "columns": [["shape", "GPUs / nodes / slots", "{}"], ["fresh", "ours fresh s", "{:.3f}"],
                    ["replan", "ours re-plan s", "{:.3f}"], ["ref_default", "DeepSeek default s", "{:.3f}"],
                    ["ref_global", "DeepSeek global s", "{:.3f}"], ["fresh_ratio", "fresh / default", "{:.2f}x"],
                    ["replan_ratio", "re-plan / default", "{:.2f}x"],
                    ["replan_drift", "drifting re-plan s", "{:.3f}"],
                    ["replan_drift_ratio", "drifting / default", "{:.2f}x"],
                    ["numpy_global", "r3trace global (numpy) s", "{:.3f}"],
                    ["static", "ours for static dispatch, fresh / re-plan s (/ default)", "{}"],
                    ["no_tokens", "ours without tokens, fresh / drifting re-plan s (/ default)", "{}"]],  # fmt: skip
        "rows": out,
    }


def _fewest(r: dict[str, Any]) -> str:
    """'1.135 (False, HiGHS, gap 11.9%)': the MILP's fewest nodes, proven or not, whose placement it is (HiGHS' own
    or the policy's, given as the incumbent and not beaten) and its gap to the proven bound."""
    whose = {"highs": "HiGHS", "incumbent": "the policy's"}.get(r.get("milp_nodes_source", ""), "?")
    gap = r.get("milp_nodes_gap")
    return (f"{r['milp_nodes_at_max_load']:.3f} ({r['milp_nodes_optimal']}, {whose}"
            + ("" if gap is None else f", gap {gap:.1%}") + ")")


def milp_claim(path: Path = MILP_FILE) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    out = []
    for r in doc["rows"]:
        bound = r["milp_max_load_bound"]
        nodes = r["milp_nodes_at_max_load"]
        out.append({"instance": r["instance"],
                    "milp": f"{r['milp_max_load']:.2f} ({bound:.2f}, {r['milp_balance_optimal']})",
                    "policy": r["policy"], "max_load": r["max_load"], "over": 100 * (r["max_load"] / bound - 1),
                    "nodes": r["nodes"],
                    "fewest": None if nodes is None else _fewest(r),
                    "at_counts": None if r.get("milp_nodes_at_counts") is None else
                    f"{r['milp_nodes_at_counts']:.4f} ({r['milp_nodes_at_counts_optimal']})"})
    return {
        "id": MILP_ID, "hardware": "cpu-2core",
        "shapes": "one layer, in sample, Zipf(0.8) tokens: synth-e16 (16 experts, top-2, 40 tokens, 4 GPUs / 2 nodes "
                  "/ 20 slots), synth-e32 (32, top-4, 96, 8 / 2 / 40), synth-e64 (64, top-6, 96, 16 / 4 / 80, 8 "
                  "groups); sample-e32: the sample model's layer 1, its first 96 tokens, 8 / 2 / 40",
        "baseline": f"the exact placement MILP (scipy's HiGHS, {doc['time_limit']:g} s a solve): max GPU load under "
                    "the even split, then the fewest covering nodes per token at the policy's own max load; the "
                    "optimum or the incumbent and its proven bound; for ours, the fewest among placements with "
                    "ours' own replica counts (`--ours-counts`)",
        "command": f"python -m bench.eplb_milp --time-limit {doc['time_limit']:g}",
        "sources": [str(path.relative_to(RESULTS.parents[1]))],
        "columns": [["instance", "instance", "{}"], ["milp", "MILP max load (bound, optimal)", "{}"],
                    ["policy", "policy", "{}"], ["max_load", "max load", "{:.2f}"], ["over", "+ vs bound", "{:+.1f}%"],
                    ["nodes", "nodes/token", "{:.3f}"],
                    ["fewest", "fewest nodes at that max load (optimal, whose placement, gap)", "{}"],
                    ["at_counts", "the same with ours' replica counts (optimal)", "{}"]],  # fmt: skip
        "rows": out,
    }


def craft_claim(path: Path = CRAFT_FILE) -> dict[str, Any]:
    """bench/eplb_craft.py's cells beside ours' rows of the same cells in the held-out matrix files."""
    doc = json.loads(path.read_text())
    ours = {r["cell"]: r["policies"]["ours"]["bal_even"] for f in matrix_files()
            for r in json.loads(f.read_text())["results"]}
    out = []
    for r in doc["results"]:
        m = {k: float(np.mean(v)) for k, v in r["rows"].items()}
        o = float(np.mean(ours[r["cell"]]))
        out.append({"cell": r["cell"], "global": m["global"], "ours": o, "craft": m["craft"],
                    "craft_half": m["craft_half"],
                    "levels": f"{int(min(r['rows']['craft_low']))}-{int(max(r['rows']['craft_high']))} "
                              f"(uniform {r['uniform_level']})",
                    "ours_vs_craft": o - m["craft"]})  # fmt: skip
    return {
        "id": CRAFT_ID, "hardware": "cpu-2core",
        "shapes": f"the held-out matrix's cells with spare slots on 4 and 8 nodes (grouped router, slow drift, "
                  f"{doc['windows']} windows of 4,096 tokens, 6 layers, E = 256) and the sample model's (4 layers, "
                  "E = 32, 8 windows) and its router serving held-out text (the sample-mix cells: slow and fast "
                  f"drift, {doc['windows']} windows); planned at the end of window t on the windows seen, scored on "
                  "window t + 1, "
                  "even split, mean over layers and held-out windows. CRAFT-style (arXiv 2603.28768; "
                  "bench/eplb_craft.py): each layer's extra slots a GPU (0-4) split over layers exactly, by the "
                  "summed in-sample balancedness of DeepSeek global's plan at each level, within the cell's "
                  "budget (its uniform spare slots) or half of it; each layer placed by global",
        "baseline": "DeepSeek's global policy at the cell's uniform slots, same windows (equal to the held-out "
                    "matrix's global rows), and ours' rows of those cells",
        "command": "python -m bench.eplb_craft",
        "sources": [str(path.relative_to(RESULTS.parents[1]))],
        "columns": [["cell", "cell", "{}"], ["global", "global", "{:.4f}"], ["ours", "ours", "{:.4f}"],
                    ["craft", "CRAFT-style, the same slots", "{:.4f}"],
                    ["craft_half", "CRAFT-style, half the spare slots", "{:.4f}"],
                    ["levels", "CRAFT-style extra slots a GPU a layer, same slots", "{}"],
                    ["ours_vs_craft", "ours - CRAFT-style, same slots", "{:+.4f}"]],  # fmt: skip
        "rows": out,
    }


def auto_claim(paths: list[Path] = AUTO_FILES) -> dict[str, Any]:
    """bench/eplb_auto.py's pick rules scored on each trace seed's file (score_rules, so the rules as now)."""
    from bench.eplb_auto import score_rules

    out = []
    for path in paths:
        doc = json.loads(path.read_text())
        seed, dispatch = doc["results"][0]["spec"]["seed"], doc.get("dispatch", "node-limited")
        cells = "sample-mix" if doc["results"][0]["spec"]["family"] == "sample-mix" else "main"
        for name, v in score_rules(doc["results"], dispatch=dispatch).items():
            first = np.mean([m for h, (m, _) in v["by_history"].items() if int(h) <= 3])
            out.append({"sweep": cells, "seed": seed, "dispatch": dispatch, "rule": name,
                        "vs_ours": f"{v['vs_ours'][0]:+.4f} +- {v['vs_ours'][1]:.4f}",
                        "first": float(first), "vs_best": v["vs_best"], "nodes": v["nodes_vs_ours"] or 0.0,
                        "ours": v["ours_share"], "cells": f"{v['cells_behind']} / {v['cells_ahead']}"})
    doc = json.loads(paths[0].read_text())
    return {
        "id": AUTO_ID, "hardware": "cpu-2core",
        "shapes": f"{len(doc['results'])} cells: the matrix's three main shapes (32 / 4 / 288, 64 / 8 / 320, "
                  "144 / 18 / 288) x grouped slow skew 0.6, grouped fast skew 1.2, clustered fast and SGLang-dump "
                  "fast (heat only), and the sample model's four; 12 windows of 4,096 tokens (the sample: 8 of "
                  "1,221); at each re-plan the history is the newest 8 windows or fewer (2-8), the backtest's 4 "
                  "newest folds or fewer, every candidate planned fresh and scored on the next window: node-limited "
                  "replay of 8,192 tokens (SGLang-dump's too: its tokens are hidden from the planners and the "
                  "backtest, which ranks the even split), or with --dispatch static (dynamic) SGLang's static "
                  "(dynamic, in expectation) dispatch replayed, which the backtest then ranks and ours plans for; "
                  "synthetic traces of seeds 0, 1 and 2; sample-mix: the sample model's router on a serving stream of "
                  "held-out text (bench/eplb_traces.py), its four shapes x slow and fast drift, 12 windows",
        "baseline": "ours + ema (the candidate `--policy ours` plans: where the history drifts, on the windows at "
                    "the long-run mix of their kinds of token, fitted on each window's first 2,048 routes), every "
                    "fixed candidate, and the best candidate in hindsight, scored on the same windows",
        "command": "python -m bench.eplb_auto [--seed N --out bench/results/eplb-auto-seedN.json] [--dispatch D "
                   "--out bench/results/eplb-auto-D.json] (D: static, dynamic) [--sweep sample-mix --out "
                   "bench/results/eplb-auto-sample-mix[-seedN].json]",
        "sources": [str(p.relative_to(RESULTS.parents[1])) for p in paths],
        "columns": [["sweep", "cells", "{}"], ["seed", "trace seed", "{}"],
                    ["dispatch", "judged by (--dispatch)", "{}"], ["rule", "pick", "{}"],
                    ["vs_ours", "held out - ours + ema (mean +- SE over re-plans)", "{}"],
                    ["first", "the same at 2-3 history windows", "{:+.4f}"],
                    ["vs_best", "- best in hindsight", "{:+.4f}"], ["nodes", "nodes/token - ours'", "{:+.3f}"],
                    ["ours", "picked ours", "{:.0%}"], ["cells", "cells behind / ahead of ours beyond 2 SE", "{}"]],
        "rows": out,
    }


def claims() -> list[dict[str, Any]]:
    """BENCHMARKS.md's EPLB tables as latest.json claims, computed from the result files."""
    return [matrix_claim(matrix_files()), plan_time_claim(), mix_time_claim(), milp_claim(), craft_claim(),
            keep_groups_claim(), hindsight_claim(), auto_claim(), churn_claim(), copies_claim()]


def write_latest(new: list[dict[str, Any]], path: Path = LATEST) -> None:
    """Replace the claims of the same ids in latest.json (new ones go after the last EPLB claim)."""
    doc = json.loads(path.read_text())
    ids = {c["id"]: c for c in new}
    kept = [ids.pop(c["id"], c) for c in doc["claims"]]
    at = max((i for i, c in enumerate(kept) if c["id"].startswith("eplb")), default=len(kept) - 1) + 1
    doc["claims"] = kept[:at] + list(ids.values()) + kept[at:]
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
