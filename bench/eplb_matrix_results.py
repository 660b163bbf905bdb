"""The held-out matrix's result rows (bench/eplb_matrix.py) read back: per-policy means and paired standard errors
against a baseline, ours' dominance flags, the printed table, and a result file updated with a re-run of some of its
cells.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

METRICS = ("bal_even", "bal_node_limited", "bal_static", "bal_dynamic", "nodes", "over_limit", "churn")
RESULTS = Path(__file__).resolve().parent / "results"


def summary(res: dict[str, Any], base: str) -> dict[str, dict[str, list[float]]]:
    """{policy: {metric: [mean, standard error of the paired difference vs `base`]}}, the metrics a row has (a row
    reused from a run before a metric was added lacks it)."""
    pols = res["policies"]
    out: dict[str, dict[str, list[float]]] = {}
    for name, rows in pols.items():
        out[name] = {}
        for m in (m for m in METRICS if m in rows and m in pols[base]):
            a = np.asarray(rows[m])
            d = a - np.asarray(pols[base][m])
            se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
            out[name][m] = [float(a.mean()), float(d.mean()), se]
    return out


def dominates(res: dict[str, Any]) -> dict[str, bool]:
    """Ours >= global and global-newest on both balancedness models, and <= global's nodes per token (means)."""
    s = summary(res, "global")
    o = s["ours"]
    ok = {f"bal_even>={b}": o["bal_even"][0] >= s[b]["bal_even"][0] for b in ("global", "global-newest")}
    ok |= {f"bal_nl>={b}": o["bal_node_limited"][0] >= s[b]["bal_node_limited"][0]
           for b in ("global", "global-newest")}
    ok["nodes<=global"] = o["nodes"][0] <= min(s["global"]["nodes"][0], s["global-newest"]["nodes"][0])
    if "hierarchical" in s:
        h = s["hierarchical"]
        ok["nodes<=hier"] = o["nodes"][0] <= h["nodes"][0]
        ok["bal_even>hier"] = o["bal_even"][0] > h["bal_even"][0]
    return ok


def table(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| cell | policy | bal. even | vs global | bal. node-limited | vs global | nodes/token | vs global | "
             "> 4 nodes | churn |", "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        s = summary(res, "global")
        for name, m in s.items():
            be, bn, nd = m["bal_even"], m["bal_node_limited"], m["nodes"]
            lines.append(
                f"| {res['cell']} | {name} | {be[0]:.3f} | {be[1]:+.3f} +- {be[2]:.3f} | {bn[0]:.3f} | "
                f"{bn[1]:+.3f} +- {bn[2]:.3f} | {nd[0]:.2f} | {nd[1]:+.2f} +- {nd[2]:.2f} | "
                f"{m['over_limit'][0]:.1%} | {m['churn'][0]:.1%} |")
    return lines


def updated(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A results file and a run of some of its cells (the same sweep and trace) -> the file with those cells'
    results replaced, in its own order; each update's args listed under "updates"."""
    keys = ("layers", "windows", "window_tokens", "seed")
    if old["sweep"] != new["sweep"] or any(old["args"][k] != new["args"][k] for k in keys):
        raise SystemExit(f"--update: the file's sweep and {keys} differ from this run's")
    fresh = {r["cell"]: r for r in new["results"]}
    missing = set(fresh) - {r["cell"] for r in old["results"]}
    if missing:
        raise SystemExit(f"--update: cells not in the file: {sorted(missing)}")
    return {**old, "results": [fresh.get(r["cell"], r) for r in old["results"]],
            "updates": [*old.get("updates", []), {"args": new["args"], "machine": new["machine"]}]}
