"""The EPLB matrix's report from its result files (bench/results/eplb-matrix-*.json): the held-out summary (a claim of
bench/results/latest.json, with bench/eplb_claims.py's other EPLB tables) and every cell's row.

Run: .venv/bin/python -m bench.eplb_report            the summary table (one row per result file, then all cells)
     .venv/bin/python -m bench.eplb_report --cells    every cell's row, ours against DeepSeek's policies held out
     .venv/bin/python -m bench.eplb_report --latest   write every EPLB claim into latest.json (bench/eplb_claims.py;
                                                      then python -m bench.tables rewrites BENCHMARKS.md)

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

from bench.eplb_matrix_results import RESULTS, summary
from bench.tables import LATEST

SUMMARY_ID = "eplb-held-out-matrix"
SWEEPS = {  # a result file's sweep -> what its cells vary (the summary's first column)
    "shape": "shapes: slots x skew, grouped router, slow drift",
    "family": "trace families x drift",
    "groups1": "a router without groups",
    "sample": "the sample model's traces",
    "sample-mix": "the sample model's router, a serving stream of held-out text",
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
                  "windows of its traces, 4 MoE layers, 32 experts, top-4; the sample-mix cells: windows of 32 "
                  "requests of 128 tokens of its routes on held-out text, each request's domain from shares that "
                  "drift, bench/sample_routes.py); every policy plans at the end of window t "
                  f"and is scored on window t + 1 from t = 2 on, {held.get(False, 0)} held-out windows a cell (the "
                  f"sample's {held.get(True, 0)}); "
                  "balancedness = mean over layers of mean / max GPU load, the even split of each expert's load "
                  "over its replicas",
        "baseline": "DeepSeek's global policy on all windows seen (r3trace/eplb/deepseek.py, equal to "
                    "deepseek-ai/EPLB eplb.py d52c72d) and on the newest window, hierarchical, a GRACE-MoE-style "
                    "baseline, in the same run on the same windows",
        "command": "python -m bench.eplb_matrix --sweep SWEEP --nodes N --out FILE (trace seeds 1 and 2: --seed S "
                   "--out bench/results/eplb-matrix-SWEEP-seedS.json; ours' rows of some cells of a file: --nodes N "
                   "--update FILE; ours' rows of every file: python -m bench.eplb_rerun); python -m bench.eplb_report "
                   "--latest",
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, help="result files (default: every held-out one)")
    ap.add_argument("--cells", action="store_true", help="every cell's row instead of the summary")
    ap.add_argument("--latest", action="store_true", help="write the EPLB claims into bench/results/latest.json")
    ap.add_argument("--smoke", action="store_true", help="the summary and every cell of the committed files")
    args = ap.parse_args(argv)
    files = args.files or matrix_files()
    if args.latest:
        from bench.eplb_claims import claims, write_latest  # it builds this module's matrix claim

        new = claims()
        write_latest(new)
        print(f"{LATEST}: {', '.join(c['id'] for c in new)} rewritten; run python -m bench.tables")
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
