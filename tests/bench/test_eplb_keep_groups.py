"""bench/eplb_keep_groups.py: its cells are every matrix cell where DeepSeek's hierarchical policy exists on several
nodes, a cell's verdicts are keep-groups minus hierarchical per metric, and the claim counts cells by sign.
Run: .venv/bin/pytest tests/bench/test_eplb_keep_groups.py -q"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.eplb_keep_groups import keep_cells, keep_groups_claim, verdicts
from bench.eplb_matrix import Cell, cells, run_cell
from bench.eplb_traces import TraceSpec


def test_cells_are_the_matrix_cells_where_hierarchical_exists() -> None:
    base = TraceSpec(windows=20)
    every = [c for sweep in ("shape", "family", "sample") for c in cells(sweep, base)]
    got = {c.name() for c in keep_cells(base)}
    want = {c.name() for c in every if c.nodes > 1 and c.spec.num_groups % c.nodes == 0}
    assert got == want and len(got) == 78
    assert all(c.nodes in (2, 4, 8) for c in keep_cells(base))


def test_a_cell_scores_both_policies_and_the_claim_counts_signs(tmp_path: Path) -> None:
    """One small cell run for real; then a results file of three made-up cells: the claim's counts and medians."""
    c = keep_cells(TraceSpec(windows=20))[4]  # grouped s = 0.3, 16 / 2 / 288
    res = run_cell(Cell(replace(c.spec, num_layers=2, windows=5, window_tokens=512), c.gpus, c.nodes, c.slots),
                   variants=True, only=("hierarchical", "ours-keep-groups"))
    assert set(res["policies"]) == {"hierarchical", "ours-keep-groups"}
    v = verdicts(res)
    k, h = res["policies"]["ours-keep-groups"], res["policies"]["hierarchical"]
    assert v["nodes"] == float(np.mean(np.asarray(k["nodes"]) - np.asarray(h["nodes"])))
    assert len(k["bal_even"]) == 2  # windows 0..4: planned at t = 1..3, the cold plan unscored

    def cell(nodes: int, dn: float, de: float, family: str = "grouped") -> dict[str, object]:
        rows = {"nodes": [2.0], "bal_even": [0.8], "bal_node_limited": [0.8], "over_limit": [0.0]}
        mine = {"nodes": [2.0 + dn], "bal_even": [0.8 + de], "bal_node_limited": [0.8 - de], "over_limit": [0.1]}
        return {"cell": f"{family}/{nodes}", "nodes": nodes, "spec": {"family": family},
                "policies": {"hierarchical": rows, "ours-keep-groups": mine}}

    doc = {"args": {"seed": 0, "windows": 20},
           "results": [cell(2, -0.5, 0.01), cell(2, 0.0, -0.02), cell(2, 0.25, 0.03), cell(4, -0.1, 1e-12, "sample")]}
    path = tmp_path / "kg.json"
    path.write_text(json.dumps(doc))
    rows = {r["cells"]: r for r in keep_groups_claim([path])["rows"]}
    two = rows["synthetic routers; 2 nodes"]
    assert (two["n"], two["nodes_fewer"], two["even_above"], two["nl_above"]) == (3, "1 / 1 / 1", "2 / 0 / 1",
                                                                                  "1 / 0 / 2")
    assert two["nodes_median"] == 0.0 and two["nodes_worst"] == 0.25
    assert abs(two["even_median"] - 0.01) < 1e-12 and abs(two["even_worst"] + 0.02) < 1e-12
    assert abs(two["nl_worst"] + 0.03) < 1e-12 and two["over"] == 0.1
    assert rows["the sample model's traces; 4 nodes"]["even_above"] == "0 / 1 / 0"  # level within 1e-9 (float rounding)
