"""temporal_locality's two ways to the previous position (the packed sort key, the partitioned window) and its two
heat sources, against numpy over two runs that share request ids.

Run: .venv/bin/pytest tests/analysis/test_temporal_locality.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from r3trace.analysis import locality
from r3trace.analysis.store import TraceStore
from tests.analysis.conftest import MOE, K, random_routes, write_run


def two_runs(root: Path) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Runs 'a' and 'b' with the same request ids: 'a' 5 requests of 0-29 tokens, positions with a gap; 'b' 3
    requests whose positions start at 7. A pair across runs, across layers or across a gap would be counted wrong."""
    rng = np.random.default_rng(23)
    out = {}
    for run, n_req, start in (("a", 5, 0), ("b", 3, 7)):
        lengths = rng.integers(0, 30, n_req)
        req = np.concatenate([np.full(n, f"r{i}") for i, n in enumerate(lengths)])
        pos = np.concatenate([start + np.arange(n) for n in lengths])
        pos[pos >= start + 12] += 3  # positions 12.. of every request after a gap of 3: no pair across it
        ids = random_routes(rng, len(req))
        fwd = pos.astype(np.int64) - start
        write_run(root, run, ids, req, pos, np.full(len(req), "decode"), fwd, rows_per_file=64)
        out[run] = (ids, req, pos)
    return out


def np_overlaps(ids: np.ndarray, req: np.ndarray, pos: np.ndarray, li: int) -> list[float]:
    ov = []
    for r in np.unique(req):
        m = np.flatnonzero(req == r)
        m = m[np.argsort(pos[m])]
        ov += [len(set(ids[a, li]) & set(ids[b, li])) / K
               for a, b in zip(m[:-1], m[1:], strict=True) if pos[b] == pos[a] + 1]
    return ov


@pytest.mark.parametrize("run_id", ["a", "b", None])
def test_locality_equals_numpy_by_either_key_and_source(tmp_path: Path, run_id: str | None) -> None:
    runs = two_runs(tmp_path)
    s = TraceStore(tmp_path)
    chosen = [v for k, v in runs.items() if run_id in (None, k)]
    got = {(packed, source): locality.temporal_locality(s.con, run_id, source=source, packed_key=packed)
           for packed in (True, False) for source in ("routes", "rollups")}
    first = got[True, "routes"]
    assert first["layer_id"].to_list() == list(MOE)
    for li, row in enumerate(first.iter_rows(named=True)):
        ov = [o for ids, req, pos in chosen for o in np_overlaps(ids, req, pos, li)]
        assert row["pairs"] == len(ov) and row["mean_overlap"] == pytest.approx(np.mean(ov), rel=1e-12)
        counts = sum(np.bincount(ids[:, li].ravel(), minlength=16) for ids, _, _ in chosen)
        pi = counts / sum(len(ids) for ids, _, _ in chosen)
        assert row["baseline"] == pytest.approx((pi**2).sum() / K, rel=1e-12)
    for frame in got.values():
        assert frame["layer_id"].to_list() == first["layer_id"].to_list()
        assert frame["pairs"].to_list() == first["pairs"].to_list()
        assert np.allclose(frame.select("mean_overlap", "baseline").to_numpy(),
                           first.select("mean_overlap", "baseline").to_numpy(), rtol=1e-12, atol=0)
    one = locality.temporal_locality(s.con, run_id, layer_id=4, source="rollups")
    [want] = [r for r in first.to_dicts() if r["layer_id"] == 4]
    [row] = one.to_dicts()
    assert row == pytest.approx(want, rel=1e-12)


def test_stats_reads_the_rollups_only_where_every_routes_file_has_one(tmp_path: Path, capsys: pytest.CaptureFixture
                                                                       ) -> None:
    """`r3trace stats` on a run as TraceWriter wrote it (heat from the rollups) and on the same run listed without
    rollups, as another tool may write the Parquet contract (heat from the routes): the same figures."""
    from r3trace.cli import main

    two_runs(tmp_path / "t")
    manifest = next((tmp_path / "t").glob("run_id=a/manifest.json"))
    assert TraceStore(tmp_path / "t").runs[0].rollups_complete
    assert main(["stats", str(tmp_path / "t"), "--run-id", "a", "--layers"]) == 0
    with_rollups = capsys.readouterr().out
    doc = json.loads(manifest.read_text())
    doc["files"] = [{**f, "rollup": None} for f in doc["files"]]
    manifest.write_text(json.dumps(doc))
    for f in (tmp_path / "t" / "rollups" / "run_id=a").glob("*.parquet"):
        f.unlink()
    assert not [r for r in TraceStore(tmp_path / "t").runs if r.manifest.run_id == "a"][0].rollups_complete
    assert main(["stats", str(tmp_path / "t"), "--run-id", "a", "--layers"]) == 0
    assert capsys.readouterr().out == with_rollups
    assert "temporal locality: mean overlap" in with_rollups
