"""Rows whose physical_ids do not hold their topk_ids under the placement of their forward (analysis/integrity.py's
unplaced_rows, one DuckDB ASOF join), against the Python reader's placement_at row by row; `r3trace stats` prints
the count, the dashboard's overview warns.
Run: .venv/bin/pytest tests/analysis/test_unplaced_rows.py -q
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from r3trace.analysis.integrity import Unplaced, unplaced_rows
from r3trace.analysis.store import TraceStore
from r3trace.cli import main
from r3trace.trace.placements import placement_at
from r3trace.trace.reader import open_dataset
from r3trace.trace.writer import TraceWriter

LAYERS, E, P, K, T = (1, 2, 3), 16, 20, 2, 40


def maps(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(np.arange(P) % E) for _ in LAYERS])  # [L, P]


def write(root: Path, run: str, recorded: list[tuple[int, np.ndarray]], ran: list[tuple[int, np.ndarray]]) -> None:
    """T tokens, one a forward; slots picked under the maps `ran` (from_forward, [L, P]); `recorded` written as the
    run's placements, in order."""
    rng = np.random.default_rng(5)
    logical = np.argsort(rng.random((T, len(LAYERS), E)), axis=-1)[..., :K]  # [T, L, K] distinct
    phys = np.zeros_like(logical)
    for (t, li, k), e in np.ndenumerate(logical):
        m = [m for f, m in ran if f <= t][-1]
        phys[t, li, k] = rng.choice(np.flatnonzero(m[li] == e))
    with TraceWriter(root, model_name="m", num_hidden_layers=4, moe_layer_ids=LAYERS, num_experts=E, top_k=K,
                     run_id=run, with_physical_ids=True) as w:
        for f, m in recorded:
            w.add_placement(f, LAYERS, m)
        w.append_tokens("r", np.arange(T), "decode", "computed", np.arange(T), 0, 0, logical, physical_ids=phys)


def python_count(root: Path, run: str) -> tuple[int, int]:
    """(rows whose slots miss their experts, rows before any map), by placement_at forward by forward."""
    r = [x for x in open_dataset(root) if x.manifest.run_id == run][0]
    t = TraceStore(root).con.execute("SELECT forward_id, layer_id, topk_ids, physical_ids FROM routes "
                                     "WHERE run_id = ?", [run]).fetchall()
    bad = unmapped = 0
    for f, layer, ids, slots in t:
        try:
            m = placement_at(r, f)[LAYERS.index(layer)]
        except ValueError:
            unmapped += 1
            continue
        bad += list(m[np.asarray(slots)]) != list(ids)
    return bad, unmapped


@pytest.mark.parametrize("case", ["both recorded", "rebalance unrecorded", "late first map", "tie, later wins",
                                  "tie, later wrong"])
def test_sql_count_equals_the_python_reader(tmp_path: Path, case: str) -> None:
    a, b = maps(1), maps(2)
    recorded, ran = {
        "both recorded": ([(0, a), (20, b)], [(0, a), (20, b)]),
        "rebalance unrecorded": ([(0, a)], [(0, a), (20, b)]),
        "late first map": ([(5, a)], [(0, a)]),
        "tie, later wins": ([(0, a), (20, a), (20, b)], [(0, a), (20, b)]),
        "tie, later wrong": ([(0, a), (20, b), (20, a)], [(0, a), (20, b)]),
    }[case]
    write(tmp_path, "a", recorded, ran)
    got = unplaced_rows(TraceStore(tmp_path).con, "a")
    bad, unmapped = python_count(tmp_path, "a")
    assert got == Unplaced(bad, unmapped, T * len(LAYERS))
    if case in ("both recorded", "tie, later wins"):
        assert got.rows == 0 and got.unmapped == 0
    elif case == "late first map":
        assert got == Unplaced(0, 5 * len(LAYERS), T * len(LAYERS))
    else:  # forwards 20.. read through the wrong map: most of their rows miss
        assert 0.7 * 20 * len(LAYERS) < got.rows <= 20 * len(LAYERS)


def test_stats_prints_the_count_and_the_placement_history(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, "ok", [(0, maps(1)), (20, maps(2))], [(0, maps(1)), (20, maps(2))])
    write(tmp_path, "off", [(5, maps(1))], [(0, maps(1)), (20, maps(2))])
    with TraceWriter(tmp_path, model_name="m", num_hidden_layers=4, moe_layer_ids=LAYERS, num_experts=E, top_k=K,
                     run_id="bare", with_physical_ids=True) as w:
        w.append_tokens("r", np.arange(2), "decode", "computed", 0, 0, 0, np.tile(np.arange(K), (2, 3, 1)),
                        physical_ids=np.tile(np.arange(K), (2, 3, 1)))
    bad, _ = python_count(tmp_path, "off")
    assert main(["stats", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    moved = int((maps(1) != maps(2)).sum())
    assert [x for x in lines if x.startswith("placements:")] == [
        "placements: a map of 3 layers from forward 5, never switched",
        f"placements: a map of 3 layers from forward 0; 1 switch moving {moved} slots: forward 20 (3 layers, {moved} "
        "of 60 slots moved)"]
    said = [x for x in lines if "physical_ids" in x]
    assert said == ["physical_ids without a placements table: slots cannot be checked against experts",
                    f"rows whose physical_ids miss their experts under their forward's placement: {bad:,} of 105 "
                    "(15 rows before the first map)",
                    "rows whose physical_ids miss their experts under their forward's placement: 0 of 120"]
