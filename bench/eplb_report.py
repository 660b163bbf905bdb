"""Markdown tables of the EPLB matrix from its result files (bench/results/eplb-matrix-*.json): one row per cell,
ours against DeepSeek's policies held out. Run: .venv/bin/python -m bench.eplb_report [FILES...]

Verdict per cell, on means over the held-out windows: "yes" when ours' even-split balancedness is >= both
global policies' and its nodes per token <= global's; "tie" when it misses the better global policy by less than
two standard errors of the paired difference (and wins on nodes); "no" otherwise, with the miss.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_matrix import RESULTS, summary


def verdict(res: dict[str, Any]) -> str:
    pols = res["policies"]
    ours = np.asarray(pols["ours"]["bal_even"])
    base = max(("global", "global-newest"), key=lambda b: float(np.mean(pols[b]["bal_even"])))
    d = ours - np.asarray(pols[base]["bal_even"])  # paired over the held-out windows
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
    nodes_ok = np.mean(pols["ours"]["nodes"]) <= np.mean(pols["global"]["nodes"]) + 1e-9
    miss = -float(d.mean())
    if miss <= 0 and nodes_ok:
        return "yes"
    if nodes_ok and miss < 2 * se:
        return f"tie ({-miss:+.3f} vs {base})"
    return f"no ({-miss:+.3f} vs {base}{'' if nodes_ok else '; nodes'})"


def rows(results: list[dict[str, Any]]) -> list[str]:
    out = ["| cell | ours bal. even (vs global +- SE) | global | global newest | hier. | grace | ours bal. "
           "node-limited (vs global) | nodes/token ours / global / hier. | ours > 4 nodes | ours churn | verdict |",
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
            f"{o['churn'][0]:.1%} | {verdict(res)} |")
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--smoke"]  # --smoke (make test): the committed result files, as by default
    files = [Path(f) for f in args] or sorted(RESULTS.glob("eplb-matrix-*.json"))
    for f in files:
        doc = json.loads(f.read_text())
        if "results" not in doc:
            continue
        print(f"\n{f.name} ({len(doc['results'])} cells)\n")
        print("\n".join(rows(doc["results"])))
        counts: dict[str, int] = {}
        for res in doc["results"]:
            v = verdict(res).split(" ")[0]
            counts[v] = counts.get(v, 0) + 1
        print(f"\nverdicts: {counts}")


if __name__ == "__main__":
    main()
