"""Ours' node copies (r3trace/eplb/node_copies.py) beside its spread layout and DeepSeek's global policy, held out, on
the shapes where a node's slots hold every expert (P / N >= E), which the held-out matrix reaches only with the sample
model's 16 / 2 / 64.

Synthetic routers of bench/eplb_traces.py with E = 64, top-8, 8 groups (grouped and independent; skew 0.6 and 1.2;
slow and fast drift) on 16 GPUs / 2 nodes with 128 slots (P / N = E: one replica an expert a node) and 160 (P / N =
1.25 E), the matrix's protocol (bench/eplb_matrix.py run_cell: each policy plans at the end of window t on the windows
seen, ours from its own previous placement with the newest window's tokens, and is scored on window t + 1). Ours is
the default planner (node copies on); ours-spread the same with PlannerConfig(node_copies=False).

Run: .venv/bin/python -m bench.eplb_node_copies [--jobs N]   (16 cells, ~10 min on two cores)
     .venv/bin/python -m bench.eplb_node_copies --smoke      (one small cell, seconds)
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_matrix import WINDOWS, Cell, Policy, run_cell
from bench.eplb_ours_loads import ours_policy
from bench.eplb_report import better_global, verdict
from bench.eplb_traces import TraceSpec
from bench.result_file import run_cells
from r3trace.eplb import Cluster, PlannerConfig

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "eplb-node-copies.json"
COPIES_ID = "eplb-node-copies"
SPREAD = "ours-spread"


def copies_cells(smoke: bool = False) -> list[Cell]:
    """The 16 cells (module doc); smoke: one of 5 windows of 2,048 tokens."""
    out = [Cell(TraceSpec(family=f, zipf_s=s, drift=d, num_experts=64, num_groups=8, top_k=8, windows=WINDOWS), 16, 2,
                p)
           for f in ("grouped", "independent") for s in (0.6, 1.2) for d in ("slow", "fast") for p in (128, 160)]
    if smoke:
        c = out[0]
        return [Cell(replace(c.spec, windows=5, window_tokens=2048), c.gpus, c.nodes, c.slots)]
    return out


def spread(cl: Cluster) -> dict[str, Policy]:
    return {SPREAD: ours_policy(cl, PlannerConfig(node_copies=False))}


def _run(cell: Cell) -> dict[str, Any]:
    return run_cell(cell, only=("global", "global-newest", "ours"), extra=spread)


def rows_of(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per cell: ours (node copies) and ours-spread against the better global, under the even split and
    node-limited replay, with their nodes per token and verdicts (bench/eplb_report.verdict)."""
    out = []
    for res in results:
        pols = res["policies"]
        row: dict[str, Any] = {"cell": res["cell"],
                               "global_nodes": float(np.mean(pols["global"]["nodes"]))}
        for name, key in (("ours", "copies"), (SPREAD, "spread")):
            for metric, m in (("bal_even", "even"), ("bal_node_limited", "nl")):
                row[f"{key}_{m}"] = float(better_global(res, metric, name)[1].mean())
            row[f"{key}_nodes"] = float(np.mean(pols[name]["nodes"]))
            row[f"{key}_verdicts"] = " / ".join(verdict(res, metric, name).split(" ")[0]
                                                 for metric in ("bal_even", "bal_node_limited"))
        out.append(row)
    return out


def copies_claim(path: Path = OUT) -> dict[str, Any]:
    """BENCHMARKS.md's table from the result file."""
    doc = json.loads(path.read_text())
    return {
        "id": COPIES_ID, "hardware": "cpu-2core",
        "shapes": "synthetic routers (bench/eplb_traces.py) of 6 layers, E = 64, top-8, 8 groups, grouped and "
                  "independent, skew 0.6 and 1.2, slow and fast drift, on 16 GPUs / 2 nodes with 128 slots (P / N = E) "
                  f"and 160 (P / N = 1.25 E); {doc['args']['windows']} windows of 4,096 tokens, each policy planned at "
                  "the end of window t and scored on window t + 1 (17 held out); trace seed 0. Ours: the default "
                  "planner (node copies); ours spread: PlannerConfig(node_copies=False)",
        "baseline": "DeepSeek's global policy (r3trace/eplb/deepseek.py, equal to deepseek-ai/EPLB eplb.py d52c72d) on "
                    "all windows seen and on the newest, same windows, same run: the better of the two per metric",
        "command": "python -m bench.eplb_node_copies",
        "sources": [str(path.relative_to(ROOT))],
        "columns": [["cell", "cell", "{}"],
                    ["copies_even", "ours - the better global, even split", "{:+.4f}"],
                    ["copies_nl", "node-limited", "{:+.4f}"], ["copies_nodes", "nodes/token", "{:.2f}"],
                    ["copies_verdicts", "yes / tie / no (even / node-limited)", "{}"],
                    ["spread_even", "ours spread - the better global, even split", "{:+.4f}"],
                    ["spread_nl", "node-limited", "{:+.4f}"], ["spread_nodes", "nodes/token", "{:.2f}"],
                    ["spread_verdicts", "yes / tie / no", "{}"],
                    ["global_nodes", "global nodes/token", "{:.2f}"]],
        "rows": rows_of(doc["results"]),
    }


def main() -> None:
    for row in rows_of(run_cells(__doc__, "node-copies", copies_cells, _run, OUT)):
        print(row, flush=True)


if __name__ == "__main__":
    main()
