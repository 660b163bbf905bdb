"""bench/eplb_node_copies.py: its cells are the shapes where a node's slots hold every expert, and its rows are ours
(node copies) and ours-spread against the better global policy per metric."""

from __future__ import annotations

from bench.eplb_node_copies import SPREAD, copies_cells, rows_of


def test_every_cell_has_a_slot_for_every_expert_on_each_node() -> None:
    cells = copies_cells()
    assert len(cells) == 16
    for c in cells:
        assert c.nodes == 2 and c.slots // c.nodes >= c.spec.num_experts == 64


def test_rows_take_the_better_global_per_metric() -> None:
    def pol(even: list[float], nl: list[float], nodes: float) -> dict[str, list[float]]:
        return {"bal_even": even, "bal_node_limited": nl, "nodes": [nodes] * len(even)}

    res = {"cell": "c", "policies": {
        "global": pol([0.80, 0.82], [0.70, 0.72], 1.9),
        "global-newest": pol([0.85, 0.79], [0.60, 0.62], 1.8),  # even 0.82 (better), node-limited 0.61 (worse)
        "ours": pol([0.86, 0.84], [0.80, 0.80], 1.0),
        SPREAD: pol([0.80, 0.80], [0.70, 0.70], 1.7),
    }}
    (row,) = rows_of([res])
    assert abs(row["copies_even"] - (0.85 - 0.82)) < 1e-12  # against global-newest's mean of 0.82
    assert abs(row["copies_nl"] - (0.80 - 0.71)) < 1e-12  # against global's 0.71
    assert abs(row["spread_even"] - (0.80 - 0.82)) < 1e-12
    assert row["copies_nodes"] == 1.0 and row["spread_nodes"] == 1.7 and row["global_nodes"] == 1.9
    assert row["copies_verdicts"] == "yes / yes"
    assert row["spread_verdicts"].startswith(("tie", "no"))
