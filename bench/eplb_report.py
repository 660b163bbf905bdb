"""The EPLB matrix's report from its result files (bench/results/eplb-matrix-*.json): BENCHMARKS.md's three EPLB
tables (the held-out summary, plan time, the MILP) as claims of bench/results/latest.json, and every cell's row.

Run: .venv/bin/python -m bench.eplb_report            the summary table (one row per result file, then all cells)
     .venv/bin/python -m bench.eplb_report --cells    every cell's row, ours against DeepSeek's policies held out
     .venv/bin/python -m bench.eplb_report --latest   write the three claims into latest.json (then python -m
                                                      bench.tables rewrites BENCHMARKS.md)

Verdict per cell, on means over the held-out windows: "yes" when ours' even-split balancedness is >= both
global policies' and its nodes per token <= global's; "tie" when it misses the better global policy by less than
two standard errors of the paired difference (and wins on nodes); "no" otherwise, with the miss. The pooled verdict
(`pooled`) is the same rule over the held-out windows of the cell on every trace seed with a result file
(eplb-matrix-SWEEP-seedS.json, SEEDS): one seed's verdicts flip on changes that should not matter within ~0.0005.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_matrix import RESULTS, summary
from bench.tables import LATEST

SUMMARY_ID, PLAN_TIME_ID, MILP_ID = "eplb-held-out-matrix", "eplb-plan-time", "eplb-placement-milp"
CRAFT_ID, AUTO_ID = "eplb-replica-budget", "eplb-default-policy"
PLAN_TIME_FILE, MILP_FILE = RESULTS / "eplb-matrix-plan-time.json", RESULTS / "eplb-matrix-milp.json"
CRAFT_FILE = RESULTS / "eplb-craft.json"
# bench/eplb_auto.py on trace seeds 0, 1 and 2
AUTO_FILES = [RESULTS / "eplb-auto.json", RESULTS / "eplb-auto-seed1.json", RESULTS / "eplb-auto-seed2.json",
              RESULTS / "eplb-auto-static.json", RESULTS / "eplb-auto-dynamic.json"]
SWEEPS = {  # a result file's sweep -> what its cells vary (the summary's first column)
    "shape": "shapes: slots x skew, grouped router, slow drift",
    "family": "trace families x drift",
    "groups1": "a router without groups",
    "sample": "the sample model's traces",
}


# trace seeds of the synthetic cells (bench/eplb_traces.py TraceSpec.seed): the pooled verdict pairs ours and global
# over the held-out windows of all of them (3 x 17 a cell); the sample model's cells have one trace
SEEDS = (0, 1, 2)
# the re-plans a cell's "first" column covers: the first two after the cold plan, where the backtest has one or two
# windows to score forecasts on (forecast.MIN_DRIFT_FOLDS) and cannot call drift yet
FIRST = 2


def better_global(res: dict[str, Any], metric: str = "bal_even", ours: str = "ours") -> tuple[str, np.ndarray]:
    """-> (the global policy with the higher mean `metric` balancedness, ours - it per held-out window). metric:
    bal_even (the even split), bal_node_limited (node-limited replay of the window's tokens) or bal_static (SGLang's
    static dispatch of them, r3trace/eplb/static.py); ours: the row judged (ours-static: `--dispatch static`)."""
    pols = res["policies"]
    base = max(("global", "global-newest"), key=lambda b: float(np.mean(pols[b][metric])))
    return base, np.asarray(pols[ours][metric]) - np.asarray(pols[base][metric])


def static_row(res: dict[str, Any]) -> str:
    """The row judged under SGLang's static dispatch: ours planned for it where the cell has one (ours-static)."""
    return "ours-static" if "ours-static" in res["policies"] else "ours"


def verdict(res: dict[str, Any], metric: str = "bal_even", ours: str = "ours") -> str:
    pols = res["policies"]
    base, d = better_global(res, metric, ours)  # paired over the held-out windows
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
    nodes_ok = np.mean(pols[ours]["nodes"]) <= np.mean(pols["global"]["nodes"]) + 1e-9
    miss = -float(d.mean())
    if miss <= 0 and nodes_ok:
        return "yes"
    if nodes_ok and miss < 2 * se:
        return f"tie ({-miss:+.3f} vs {base})"
    return f"no ({-miss:+.3f} vs {base}{'' if nodes_ok else '; nodes'})"


def rows(results: list[dict[str, Any]]) -> list[str]:
    """Markdown rows, one per cell (`--cells`)."""
    out = ["| cell | ours bal. even (vs global +- SE) | global | global newest | hier. | grace | ours bal. "
           "node-limited (vs global) | nodes/token ours / global / hier. | ours > 4 nodes | churn ours / global | "
           "verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        s = summary(res, "global")
        o = s["ours"]
        h = s.get("hierarchical")
        hb, hn = (f"{h['bal_even'][0]:.3f}", f"{h['nodes'][0]:.2f}") if h else ("-", "-")
        out.append(
            f"| {res['cell']} | {o['bal_even'][0]:.3f} ({o['bal_even'][1]:+.3f} +- {o['bal_even'][2]:.3f}) | "
            f"{s['global']['bal_even'][0]:.3f} | {s['global-newest']['bal_even'][0]:.3f} | {hb} | "
            f"{s['grace']['bal_even'][0]:.3f} | {o['bal_node_limited'][0]:.3f} ({o['bal_node_limited'][1]:+.3f}) | "
            f"{o['nodes'][0]:.2f} / {s['global']['nodes'][0]:.2f} / {hn} | {o['over_limit'][0]:.1%} | "
            f"{o['churn'][0]:.1%} / {s['global']['churn'][0]:.1%} | {verdict(res)} |")
    return out


def held_out_docs() -> dict[Path, dict[str, Any]]:
    """Every held-out result file (the trade-off sweep, plan time and MILP are reported apart), read once."""
    docs = {f: json.loads(f.read_text()) for f in RESULTS.glob("eplb-matrix-*.json")}
    return {f: d for f, d in docs.items() if d.get("sweep") in SWEEPS}


def matrix_files(seed: int = 0, docs: dict[Path, dict[str, Any]] | None = None) -> list[Path]:
    """The result files of the held-out cells on trace seed `seed` (docs: held_out_docs(), where read)."""
    docs = held_out_docs() if docs is None else docs
    held_out = {f: d for f, d in docs.items() if d["args"]["seed"] == seed}
    # the sweeps in SWEEPS' order, each by its fewest nodes
    return sorted(held_out, key=lambda f: (list(SWEEPS).index(held_out[f]["sweep"]),
                                           min(r["nodes"] for r in held_out[f]["results"])))


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's results on several trace seeds -> one result whose every policy's per-window lists are the
    seeds' lists end to end (verdict() then pairs ours and global over all their held-out windows)."""
    pols = {name: {m: [v for r in runs for v in r["policies"][name][m]] for m in runs[0]["policies"][name]}
            for name in runs[0]["policies"]}
    return {**runs[0], "policies": pols}


def seed_runs(docs: dict[Path, dict[str, Any]], seeds: tuple[int, ...] = SEEDS) -> dict[str, list[dict[str, Any]]]:
    """held_out_docs() -> cell name -> its results on the trace seeds after 0 that have result files."""
    out: dict[str, list[dict[str, Any]]] = {}
    for seed in seeds[1:]:
        for f in matrix_files(seed, docs):
            for r in docs[f]["results"]:
                out.setdefault(r["cell"], []).append(r)
    return out


def summary_row(label: str, results: list[dict[str, Any]],
                more: dict[str, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """One row of the summary over `results`' cells: counts, and ours - global (all windows seen) per cell; more:
    the same cells on other trace seeds (seed_runs), whose windows the pooled verdict adds."""
    diff, nodes_diff, ge, ge_better, nodes_ok, churn, first, later = [], [], 0, 0, 0, [], [], []
    verdicts = {"yes": 0, "tie": 0, "no": 0}
    replayed, static, static_default, dynamic = dict(verdicts), dict(verdicts), dict(verdicts), dict(verdicts)
    pool = dict(verdicts)
    for res in results:
        pool[verdict(pooled([res, *(more or {}).get(res["cell"], [])])).split(" ")[0]] += 1
        s = summary(res, "global")
        ours = s["ours"]["bal_even"][0]
        diff.append(s["ours"]["bal_even"][1])
        nodes_diff.append(s["ours"]["nodes"][0] - s["global"]["nodes"][0])
        ge += ours >= s["global"]["bal_even"][0]
        ge_better += ours >= max(s["global"]["bal_even"][0], s["global-newest"]["bal_even"][0])
        nodes_ok += nodes_diff[-1] <= 1e-9
        churn.append((s["ours"]["churn"][0], s["global"]["churn"][0]))
        verdicts[verdict(res).split(" ")[0]] += 1
        replayed[verdict(res, "bal_node_limited").split(" ")[0]] += 1
        static[verdict(res, "bal_static", static_row(res)).split(" ")[0]] += 1
        static_default[verdict(res, "bal_static").split(" ")[0]] += 1
        if "ours-dynamic" in res["policies"]:
            dynamic[verdict(res, "bal_dynamic", "ours-dynamic").split(" ")[0]] += 1
        d = better_global(res)[1]
        first.append(float(d[:FIRST].mean()))
        if len(d) > FIRST:  # a cell of FIRST held-out windows or fewer has no later ones
            later.append(float(d[FIRST:].mean()))
    n = len(results)
    return {"cells": label, "n": n, "ge_global": f"{ge} of {n}", "ge_better": f"{ge_better} of {n}",
            "verdicts": f"{verdicts['yes']} / {verdicts['tie']} / {verdicts['no']}", "nodes_le": f"{nodes_ok} of {n}",
            "replayed": f"{replayed['yes']} / {replayed['tie']} / {replayed['no']}",
            "static": f"{static['yes']} / {static['tie']} / {static['no']}",
            "static_default": f"{static_default['yes']} / {static_default['tie']} / {static_default['no']}",
            "dynamic": f"{dynamic['yes']} / {dynamic['tie']} / {dynamic['no']}",
            "pooled": f"{pool['yes']} / {pool['tie']} / {pool['no']}",
            "diff_median": float(np.median(diff)), "diff_worst": float(min(diff)),
            "nodes_diff_median": float(np.median(nodes_diff)),
            "first_later": f"{np.mean(first):+.4f} / " + (f"{np.mean(later):+.4f}" if later else "-"),
            "churn": "{:.1%} / {:.0%}".format(*np.median(churn, axis=0))}  # fmt: skip


def matrix_claim(files: list[Path]) -> dict[str, Any]:
    docs = held_out_docs()
    table, every, more = [], [], seed_runs(docs)
    for f in files:
        doc = docs[f] if f in docs else json.loads(f.read_text())
        nodes = sorted({r["nodes"] for r in doc["results"]})
        span = f"{nodes[0]}" if len(nodes) == 1 else f"{nodes[0]}-{nodes[-1]}"
        table.append(summary_row(f"{SWEEPS.get(doc['sweep'], doc['sweep'])}; {span} nodes", doc["results"], more))
        every += doc["results"]
    table.append(summary_row("all cells", every, more))
    held = {r["spec"]["family"] == "sample": len(r["policies"]["ours"]["bal_even"]) for r in every}
    return {
        "id": SUMMARY_ID, "hardware": "cpu-2core",
        "shapes": f"each cell {held.get(False, 0) + 3} consecutive windows of 4,096 tokens from a 6-layer, "
                  f"256-expert, top-8 router (bench/eplb_traces.py; the sample model's cells: {held.get(True, 0) + 3} "
                  "windows of its traces, 4 MoE layers, 32 experts, top-4); every policy plans at the end of window t "
                  f"and is scored on window t + 1 from t = 2 on, {held.get(False, 0)} held-out windows a cell (the "
                  f"sample's {held.get(True, 0)}); "
                  "balancedness = mean over layers of mean / max GPU load, the even split of each expert's load "
                  "over its replicas",
        "baseline": "DeepSeek's global policy on all windows seen (r3trace/eplb/deepseek.py, equal to "
                    "deepseek-ai/EPLB eplb.py d52c72d) and on the newest window, hierarchical, a GRACE-MoE-style "
                    "baseline, in the same run on the same windows",
        "command": "python -m bench.eplb_matrix --sweep SWEEP --nodes N --out FILE (trace seeds 1 and 2: --seed S "
                   "--out bench/results/eplb-matrix-SWEEP-seedS.json; ours' rows of some cells of a file: --nodes N "
                   "--update FILE); python -m bench.eplb_report --latest",
        "sources": [str(f.relative_to(RESULTS.parents[1])) for f in files + [g for seed in SEEDS[1:]
                                                                                 for g in matrix_files(seed, docs)]],
        "columns": [["cells", "cells", "{}"], ["n", "n", "{}"], ["ge_global", "ours >= global", "{}"],
                    ["ge_better", ">= the better global", "{}"], ["verdicts", "yes / tie / no", "{}"],
                    ["nodes_le", "nodes/token <= global", "{}"],
                    ["replayed", "yes / tie / no, node-limited replay", "{}"],
                    ["static_default", "yes / tie / no, SGLang static dispatch", "{}"],
                    ["static", "the same, ours planned for it (--dispatch static)", "{}"],
                    ["dynamic", "SGLang dynamic dispatch, ours planned for it (--dispatch dynamic)", "{}"],
                    ["pooled", f"yes / tie / no, trace seeds {SEEDS[0]}-{SEEDS[-1]} pooled", "{}"],
                    ["diff_median", "ours - global, median", "{:+.3f}"],
                    ["diff_worst", "worst", "{:+.3f}"], ["nodes_diff_median", "nodes/token ours - global, median",
                                                          "{:+.2f}"],
                    ["first_later", f"ours - the better global, first {FIRST} re-plans / later, mean", "{}"],
                    ["churn", "slots moved a re-plan, ours / global, median", "{}"]],  # fmt: skip
        "rows": table,
    }


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
                  "from 4 windows of fast drift (sigma 0.3 logits a window) to 5, the backtest calling drift",
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
                  "E = 32, 8 windows); planned at the end of window t on the windows seen, scored on window t + 1, "
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
        for name, v in score_rules(doc["results"], dispatch=dispatch).items():
            first = np.mean([m for h, (m, _) in v["by_history"].items() if int(h) <= 3])
            out.append({"seed": seed, "dispatch": dispatch, "rule": name,
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
                  "synthetic traces of seeds 0, 1 and 2",
        "baseline": "ours + ema (the candidate `--policy ours` plans), every fixed candidate, and the best candidate "
                    "in hindsight, scored on the same windows",
        "command": "python -m bench.eplb_auto [--seed N --out bench/results/eplb-auto-seedN.json] [--dispatch D "
                   "--out bench/results/eplb-auto-D.json] (D: static, dynamic)",
        "sources": [str(p.relative_to(RESULTS.parents[1])) for p in paths],
        "columns": [["seed", "trace seed", "{}"], ["dispatch", "judged by (--dispatch)", "{}"], ["rule", "pick", "{}"],
                    ["vs_ours", "held out - ours + ema (mean +- SE over re-plans)", "{}"],
                    ["first", "the same at 2-3 history windows", "{:+.4f}"],
                    ["vs_best", "- best in hindsight", "{:+.4f}"], ["nodes", "nodes/token - ours'", "{:+.3f}"],
                    ["ours", "picked ours", "{:.0%}"], ["cells", "cells behind / ahead of ours beyond 2 SE", "{}"]],
        "rows": out,
    }


def claims() -> list[dict[str, Any]]:
    """BENCHMARKS.md's EPLB tables as latest.json claims, computed from the result files."""
    from bench.eplb_keep_groups import keep_groups_claim

    return [matrix_claim(matrix_files()), plan_time_claim(), milp_claim(), craft_claim(), keep_groups_claim(),
            auto_claim()]


def write_latest(new: list[dict[str, Any]], path: Path = LATEST) -> None:
    """Replace the claims of the same ids in latest.json (new ones go after the last EPLB claim)."""
    doc = json.loads(path.read_text())
    ids = {c["id"]: c for c in new}
    kept = [ids.pop(c["id"], c) for c in doc["claims"]]
    at = max((i for i, c in enumerate(kept) if c["id"].startswith("eplb")), default=len(kept) - 1) + 1
    doc["claims"] = kept[:at] + list(ids.values()) + kept[at:]
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, help="result files (default: every held-out one)")
    ap.add_argument("--cells", action="store_true", help="every cell's row instead of the summary")
    ap.add_argument("--latest", action="store_true", help="write the EPLB claims into bench/results/latest.json")
    ap.add_argument("--smoke", action="store_true", help="the summary and every cell of the committed files")
    args = ap.parse_args(argv)
    files = args.files or matrix_files()
    if args.latest:
        write_latest(claims())
        print(f"{LATEST}: {SUMMARY_ID}, {PLAN_TIME_ID}, {MILP_ID}, {CRAFT_ID}, {AUTO_ID} rewritten; "
              "run python -m bench.tables")
        return
    if not args.cells or args.smoke:
        from bench.tables import load, render

        print(render(matrix_claim(files), load()["hardware"]))
    if args.cells or args.smoke:
        for f in files:
            doc = json.loads(f.read_text())
            print(f"\n{f.name} ({len(doc['results'])} cells)\n")
            print("\n".join(rows(doc["results"])))


if __name__ == "__main__":
    main()
