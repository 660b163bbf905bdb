"""The placements table (r3trace/trace/placements.py): committed before add_placement returns, read back as the map in
force at a forward, kept through a kill, recovery and ingest, refused in one line when it is not a placement.

    .venv/bin/pytest -q tests/trace/test_placements.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from r3trace.analysis.ingest import ingest_native
from r3trace.analysis.store import TraceStore
from r3trace.phy2log import phy2log_fault
from r3trace.trace import Manifest, TraceSchemaError, TraceWriter, open_dataset, recover_run
from r3trace.trace.placements import Switch, history_line, placement_at, read_placements, switches

REPO = Path(__file__).resolve().parents[2]
MOE, E, K = (1, 2, 3), 6, 2  # MoE layers of a 4-layer model; P = 8 slots below


def writer(root: Path, run_id: str = "p") -> TraceWriter:
    return TraceWriter(root, model_name="t", num_hidden_layers=4, moe_layer_ids=MOE, num_experts=E, top_k=K,
                       run_id=run_id, flush_interval_s=None)


def maps(seed: int) -> np.ndarray:
    """[3, 8]: per MoE layer a shuffle of the 6 experts, then two replicas."""
    rng = np.random.default_rng(seed)
    return np.array([np.concatenate([rng.permutation(E), rng.integers(0, E, 2)]) for _ in MOE])


def test_a_map_holds_from_its_forward_until_the_next_row_of_its_layer(tmp_path: Path) -> None:
    a, b = maps(0), maps(1)
    with writer(tmp_path) as w:
        w.add_placement(3, MOE, a)
        assert Manifest.read(w.run_dir).placements == ("placement-00000.parquet",)  # listed before it returned
        w.add_placement(10, (2,), b[1:2])
        w.add_placement(10, (2,), a[1:2])  # one forward, one layer, twice: the later row is what ran
        w.add_placement(12, (1, 3), b[[0, 2]])
    run = open_dataset(tmp_path)[0]
    assert read_placements(run).num_rows == 3 + 1 + 1 + 2
    assert np.array_equal(placement_at(run, 3), a)
    assert np.array_equal(placement_at(run, 11), a)  # layer 2's second row at 10 put a's row back
    assert np.array_equal(placement_at(run, 12), np.stack([b[0], a[1], b[2]]))
    assert np.array_equal(placement_at(run), placement_at(run, 12))
    with pytest.raises(TraceSchemaError, match="records no expert placement at forward 2"):
        placement_at(run, 2)
    got = TraceStore(tmp_path).query("SELECT from_forward_id, layer_id, phy2log FROM placements "
                                     "WHERE from_forward_id = 12 ORDER BY layer_id")
    assert got["layer_id"].to_list() == [1, 3] and got["phy2log"].to_list() == b[[0, 2]].tolist()


def test_switches_count_each_forwards_layers_and_moved_slots(tmp_path: Path) -> None:
    """The history `r3trace stats` prints: the first map places every slot; a switch counts the slots whose expert
    differs from the layer's map before, the later of two rows of one layer and forward counting."""
    a, b = maps(0), maps(1)
    with writer(tmp_path) as w:
        w.add_placement(3, MOE, a)
        w.add_placement(10, (2,), b[1:2])
        w.add_placement(10, (2,), a[1:2])  # layer 2 back to a: nothing moved at 10
        w.add_placement(12, (1, 3), b[[0, 2]])
    got = switches(open_dataset(tmp_path)[0])
    moved = int((a[[0, 2]] != b[[0, 2]]).sum())
    assert got == [Switch(3, 3, 24, 24), Switch(10, 1, 8, 0), Switch(12, 2, 16, moved)]
    assert history_line(got, shown=1) == (f"placements: a map of 3 layers from forward 3; 2 switches moving {moved} "
                                            "slots: forward 10 (1 layer, 0 of 8 slots moved), and 1 more")


def test_a_run_without_placements_has_an_empty_view_and_says_so(tmp_path: Path) -> None:
    writer(tmp_path).close()
    run = open_dataset(tmp_path)[0]
    assert not (tmp_path / "placements").exists()  # made with the first placement, not for every run
    assert TraceStore(tmp_path).query("SELECT count(*) AS n FROM placements")["n"][0] == 0
    with pytest.raises(TraceSchemaError, match="run p records no expert placement"):
        placement_at(run)


@pytest.mark.parametrize(("row", "fault"), [
    ([2, 0, 1, 1], None),  # expert 1 in two slots
    ([2, 0, 3, 1, 3], "slot 2 holds expert 3, outside 0..2"),  # id = E, the lowest such slot named
    ([2, -1, 1, 0], "slot 1 holds expert -1, outside 0..2"),
    ([-1, 0, 1, 3], "slot 0 holds expert -1, outside 0..2"),  # an id outside is named before a missing expert
    ([0, 0, 0, 0], "expert 1 of 0..2 has no slot"),  # 1 and 2 have none: the lowest is named
    ([], "expert 0 of 0..2 has no slot"),
])
def test_phy2log_fault_names_the_first_bad_slot_or_missing_expert(row: list[int], fault: str | None) -> None:
    assert phy2log_fault(np.array(row, dtype=np.int64), 3) == fault


@pytest.mark.parametrize(("layers", "table", "message"), [
    ((0, 1, 2), maps(0), r"layer_ids=\[0, 1, 2\] must be distinct MoE layers of \[1, 2, 3\]"),
    ((1, 1, 2), maps(0), r"layer_ids=\[1, 1, 2\] must be distinct"),
    (MOE, maps(0)[:2], r"phy2log must be \[3 layers, P slots\] integers; it is int64 of shape \[2, 8\]"),
    (MOE, np.where(np.arange(8) == 7, 6, maps(0)), r"phy2log row of layer 1: slot 7 holds expert 6, outside 0\.\.5$"),
    (MOE, np.where(maps(0) == 4, 0, maps(0)), r"phy2log row of layer 1: expert 4 of 0\.\.5 has no slot$"),
])
def test_what_is_not_a_placement_is_refused_in_one_line(tmp_path: Path, layers: tuple[int, ...], table: np.ndarray,
                                                        message: str) -> None:
    with writer(tmp_path) as w:
        with pytest.raises(TraceSchemaError, match=message):
            w.add_placement(0, layers, table)
        with pytest.raises(TraceSchemaError, match="from_forward_id=-1 must be an integer >= 0"):
            w.add_placement(-1, MOE, maps(0))
        assert w.manifest.placements == ()
    with pytest.raises(TraceSchemaError, match="writer is closed"):
        w.add_placement(0, MOE, maps(0))


CHILD = textwrap.dedent("""
    import sys, numpy as np
    from r3trace.trace import TraceWriter
    w = TraceWriter(sys.argv[1], model_name="t", num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=6,
                    top_k=2, run_id="k", flush_interval_s=None)
    table = np.array([[int(x) for x in row.split(",")] for row in sys.argv[2].split(";")])
    w.add_placement(7, (1, 2, 3), table)
    print("placed", flush=True)
    sys.stdin.read()  # killed here, the writer open
""")


def test_a_recorded_map_survives_a_kill_recovery_and_ingest(tmp_path: Path) -> None:
    a = maps(2)
    arg = ";".join(",".join(map(str, row)) for row in a)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "src"), arg], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "placed"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    run_dir = tmp_path / "src" / "run_id=k"
    torn = run_dir.parent / "placements" / "run_id=k" / "placement-00001.parquet"  # renamed, never listed
    torn.write_bytes(b"PAR1")
    assert open_dataset(tmp_path / "src")[0].state == "crashed"
    m = recover_run(run_dir)
    assert m.placements == ("placement-00000.parquet",) and not torn.exists()
    ingest_native(tmp_path / "src", tmp_path / "store", progress=False)
    assert np.array_equal(placement_at(open_dataset(tmp_path / "store")[0]), a)
