"""TraceStore views and the read-only mode. Run: .venv/bin/pytest tests/analysis/test_store.py -q"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pytest

from r3trace.analysis.store import StoreQueryError, TraceStore


def test_views_count_what_was_written(tiny_trace: dict) -> None:
    s = TraceStore(tiny_trace["root"])
    t = len(tiny_trace["ids"])
    assert s.query("select count(*) from routes").item() == t * 3
    assert s.query("select count(*) from tokens").item() == t
    assert s.query("select count(*) from requests").item() == 6
    assert s.query("select sum(count) from rollups").item() == t * 3 * 4
    assert s.query("select num_experts, top_k, moe_layer_ids from runs").row(0) == (16, 4, [1, 2, 4])
    n_prefill = int((tiny_trace["phase"] == "prefill").sum())
    assert s.query("select count(*) from tokens where phase = ?", ["prefill"]).item() == n_prefill


def test_read_only_refuses_writes_and_outside_files(tiny_trace: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    root: Path = tiny_trace["root"]
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.csv").write_text("a\n1\n")
    s = TraceStore(root, read_only=True)
    assert s.query("select count(*) from routes").item() == len(tiny_trace["ids"]) * 3
    for sql in [f"copy (select 1) to '{root}/x.csv'", "create table t as select 1",
                "insert into runs select * from runs",
                "set threads = 8", f"attach '{root}/db.duckdb'", "install httpfs"]:
        with pytest.raises(StoreQueryError):
            s.query(sql)
    with pytest.raises(duckdb.PermissionException):
        s.query(f"select * from read_csv('{outside}/secret.csv')")
    with pytest.raises(duckdb.Error):  # locked even through the raw connection
        s.con.execute("SET enable_external_access = true")
    assert not (root / "x.csv").exists() and not list(root.glob("*.duckdb"))
    # reads inside the store still work through table functions
    part = next(root.glob("routes/run_id=a/part-*.parquet"))
    assert s.query(f"select count(*) from read_parquet('{part}')").item() > 0
    assert np.isfinite(s.query("select avg(token_pos) from routes").item())


def test_empty_store_has_every_view_and_column(tiny_trace: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A folder with no runs: each view exists with the columns a full store has, and 0 rows."""
    full, empty = TraceStore(tiny_trace["root"]), TraceStore(tmp_path_factory.mktemp("empty"))
    for view in ["routes", "tokens", "requests", "runs", "rollups"]:
        got = empty.query(f"select * from {view}")
        assert got.height == 0 and got.columns == full.query(f"select * from {view} limit 0").columns, view
    assert empty.query("select run_id, kind, rows, moe_layer_ids from runs").height == 0
