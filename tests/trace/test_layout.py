"""The store layout read by plain readers: pyarrow, polars, DuckDB (and Spark, slow) on a TraceWriter store.

    TRITON_INTERPRET=1 .venv/bin/pytest -q tests/trace/test_layout.py

Each reader's obvious call on `<store>/routes` must return the route rows only, with the counts and the values
that were written; the previous layout keeps reading through r3trace, and `migrate_run`
turns it into the new one.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from r3trace.analysis.store import TraceStore
from r3trace.cli import main
from r3trace.trace import TraceWriter, open_dataset
from r3trace.trace.layout import migrate_run
from tests.trace.stores import MOE, SHAPE, E, K, Row, heat_of, to_layout_1, write_store


def _rows(run_id: list[str], request_id: list[str], token_pos: list[int], layer_id: list[int],
          topk_ids: list[list[int]]) -> list[Row]:
    return sorted(zip(map(str, run_id), request_id, map(int, token_pos), map(int, layer_id),
                      (tuple(x) for x in topk_ids), strict=True))


def test_pyarrow_dataset_hive_reads_routes_only(tmp_path: Path) -> None:
    written = write_store(tmp_path, seed=1)
    t = ds.dataset(tmp_path / "routes", partitioning="hive").to_table()
    assert t.num_rows == len(written) == sum(r.manifest.rows for r in open_dataset(tmp_path))
    assert t.schema.field("run_id").type == pa.string()  # from the path only: no second copy in the files
    got = _rows(*(t.column(c).to_pylist() for c in ("run_id", "request_id", "token_pos", "layer_id", "topk_ids")))
    assert got == written


def test_polars_scan_parquet_reads_routes_only(tmp_path: Path) -> None:
    written = write_store(tmp_path, seed=2)
    lf = pl.scan_parquet(tmp_path / "routes")
    counts = lf.group_by("run_id").len().sort("run_id").collect()
    assert counts.rows() == [("alpha", sum(r[0] == "alpha" for r in written)),
                             ("beta", sum(r[0] == "beta" for r in written))]
    df = lf.select("run_id", "request_id", "token_pos", "layer_id", "topk_ids").collect()
    assert _rows(*(df[c].to_list() for c in df.columns)) == written


def test_duckdb_glob_reads_routes_only(tmp_path: Path) -> None:
    written = write_store(tmp_path, seed=3)
    glob = f"{tmp_path}/routes/**/*.parquet"
    con = duckdb.connect()
    [(n,)] = con.sql(f"SELECT count(*) FROM read_parquet('{glob}')").fetchall()
    assert n == len(written)  # no rollup or request rows mixed in
    got = con.sql(f"SELECT run_id, request_id, token_pos, layer_id, topk_ids FROM read_parquet('{glob}')").fetchall()
    assert sorted((r[0], r[1], r[2], r[3], tuple(r[4])) for r in got) == written
    heat = dict(((r, lay, e), c) for r, lay, e, c in con.sql(
        f"SELECT run_id, layer_id, e, count(*) FROM (SELECT run_id, layer_id, unnest(topk_ids) AS e"
        f" FROM read_parquet('{glob}')) GROUP BY ALL").fetchall())
    assert heat == heat_of(written)
    tags = con.sql(f"SELECT run_id, count(*) FROM read_parquet('{tmp_path}/requests/**/*.parquet') GROUP BY 1"
                   " ORDER BY 1").fetchall()
    assert tags == [("alpha", 3), ("beta", 2)]


def test_files_carry_shape_metadata_and_no_partition_column(tmp_path: Path) -> None:
    write_store(tmp_path, seed=4)
    run = open_dataset(tmp_path)[0]
    for path in [*run.route_files, *run.rollup_files, *run.request_files]:
        assert path.parent == tmp_path / path.parent.parent.name / "run_id=alpha"
        meta = {k.decode(): v.decode() for k, v in (pq.read_metadata(path).metadata or {}).items()}
        assert {k: json.loads(meta[k]) for k in ("num_hidden_layers", "moe_layer_ids", "top_k", "num_experts")} \
            == {"num_hidden_layers": 5, "moe_layer_ids": list(MOE), "top_k": K, "num_experts": E}
        assert "run_id" not in pq.read_schema(path).names


def test_live_run_in_flight_files_are_hidden(tmp_path: Path) -> None:
    """A recording run's routes folder opens in pyarrow and polars while a write is in flight: that file is in
    the manifest folder until its rename."""
    w = TraceWriter(tmp_path, run_id="live", flush_interval_s=None, **SHAPE)  # type: ignore[arg-type]
    w.append_tokens("r", np.arange(3), "decode", "computed", 0, 0, 0, np.tile(np.arange(K), (3, len(MOE), 1)))
    w.flush()
    (w.run_dir / ".part-00001.parquet.tmp").write_bytes(b"torn")
    assert sorted(p.name for p in (tmp_path / "routes" / "run_id=live").iterdir()) == ["part-00000.parquet"]
    assert ds.dataset(tmp_path / "routes", partitioning="hive").count_rows() == 3 * len(MOE)
    assert pl.scan_parquet(tmp_path / "routes").select(pl.len()).collect().item() == 3 * len(MOE)
    w.close()


def test_old_layout_reads_and_migrates(tmp_path: Path) -> None:
    written = write_store(tmp_path, seed=5)
    to_layout_1(tmp_path)
    assert (tmp_path / "run_id=alpha" / "part-00000.parquet").exists()
    store = TraceStore(tmp_path)
    got = store.query("SELECT run_id, request_id, token_pos, layer_id, topk_ids FROM routes")
    assert _rows(*(got[c].to_list() for c in got.columns)) == written
    assert store.query("SELECT count(*) AS n FROM requests").item() == 5
    # one run migrated, one not: a mixed store reads as one
    migrate_run(tmp_path / "run_id=alpha")
    assert not (tmp_path / "run_id=alpha" / "part-00000.parquet").exists()
    mixed = TraceStore(tmp_path)
    got = mixed.query("SELECT run_id, request_id, token_pos, layer_id, topk_ids FROM routes")
    assert _rows(*(got[c].to_list() for c in got.columns)) == written
    assert mixed.query("SELECT run_id, sum(count) AS n FROM rollups GROUP BY 1 ORDER BY 1").rows() == [
        (r, sum(c for (rr, _, _), c in heat_of(written).items() if rr == r)) for r in ("alpha", "beta")]
    # the command migrates the rest; then the plain reader sees every row
    assert main(["migrate", str(tmp_path)]) == 0
    assert {r.manifest.schema_version for r in open_dataset(tmp_path)} == {2}
    assert ds.dataset(tmp_path / "routes", partitioning="hive").count_rows() == len(written)


@pytest.mark.slow
def test_spark_heat_equals_stats(tmp_path: Path) -> None:
    """Spark in local mode reads the routes folder and gets the heat `r3trace stats` computes (heat.heat)."""
    pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install pyspark; needs Java 17)")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from r3trace.analysis.heat import heat

    written = write_store(tmp_path, seed=6)
    # ts is TIMESTAMP(NANOS): Spark refuses that Parquet type unless told to read it as a long (docs/querying.md)
    spark = SparkSession.builder.master("local[2]").appName("r3trace").config("spark.ui.enabled", "false") \
        .config("spark.sql.legacy.parquet.nanosAsLong", "true").getOrCreate()
    try:
        df = spark.read.parquet(str(tmp_path / "routes"))
        assert df.count() == len(written)
        rows = df.select("run_id", "layer_id", F.explode("topk_ids").alias("expert_id")) \
            .groupBy("run_id", "layer_id", "expert_id").count().collect()
    finally:
        spark.stop()
    spark_heat = {(r["run_id"], r["layer_id"], r["expert_id"]): r["count"] for r in rows}
    store = TraceStore(tmp_path)
    ours = {(run, lay, e): c for run in ("alpha", "beta")
            for lay, e, c in heat(store.con, run_id=run).rows()}
    assert spark_heat == ours == heat_of(written)
    assert pyspark.__version__


def test_docs_heat_queries(tmp_path: Path) -> None:
    """docs/querying.md's pyarrow and polars heat queries, as written there, give the heat of the rows written."""
    written = write_store(tmp_path, seed=7)
    t = ds.dataset(tmp_path / "routes", partitioning="hive").to_table(columns=["run_id", "layer_id", "topk_ids"])
    k = t.schema.field("topk_ids").type.list_size
    ids = t.column("topk_ids").combine_chunks().flatten()

    def rep(c: str) -> np.ndarray:
        return np.repeat(t.column(c).to_numpy(zero_copy_only=False), k)

    heat = pa.table({"run_id": rep("run_id"), "layer_id": rep("layer_id"), "expert_id": ids}) \
        .group_by(["run_id", "layer_id", "expert_id"]).aggregate([("expert_id", "count")])
    assert {(r["run_id"], r["layer_id"], r["expert_id"]): r["expert_id_count"] for r in heat.to_pylist()} \
        == heat_of(written)
    polars_heat = (pl.scan_parquet(tmp_path / "routes")
                   .select("run_id", "layer_id", pl.col("topk_ids").alias("expert_id")).explode("expert_id")
                   .group_by("run_id", "layer_id", "expert_id").len().collect())
    assert {(r, lay, e): n for r, lay, e, n in polars_heat.rows()} == heat_of(written)


def test_a_store_of_the_old_layout_migrates(tmp_path: Path) -> None:
    """tests/trace/fixtures/old_layout_store is the sample store as the previous layout's writer wrote it (files
    beside manifest.json): r3trace reads it as is, and after `r3trace migrate` the plain readers get the same rows
    and heat r3trace got before."""
    import shutil

    from r3trace.analysis.heat import heat

    store = tmp_path / "traces"
    shutil.copytree(Path(__file__).resolve().parent / "fixtures" / "old_layout_store", store)
    [run] = open_dataset(store)
    assert run.manifest.schema_version == 1 and run.route_files[0].parent == run.run_dir
    before = TraceStore(store)
    rows_before = before.query("SELECT count(*) FROM routes").item()
    heat_before = heat(before.con).rows()
    assert main(["migrate", str(store)]) == 0
    assert sorted(p.name for p in run.run_dir.iterdir() if not p.name.startswith(".")) == ["manifest.json"]
    after = TraceStore(store)
    assert heat(after.con).rows() == heat_before and rows_before == run.manifest.rows
    assert ds.dataset(store / "routes", partitioning="hive").count_rows() == rows_before
    assert pl.scan_parquet(store / "routes").select(pl.len()).collect().item() == rows_before


def test_bundled_sample_store_is_in_todays_layout() -> None:
    """samples/traces is what a new user opens first: the obvious call of each plain reader on its routes folder
    returns the route rows r3trace counts, and the files carry the shape facts."""
    import duckdb
    import pyarrow.parquet as pq

    store = Path(__file__).resolve().parents[2] / "samples" / "traces"
    rows = TraceStore(store).query("SELECT count(*) FROM routes").item()
    assert rows == 39100  # 9,775 tokens x 4 MoE layers
    assert ds.dataset(store / "routes", partitioning="hive").count_rows() == rows
    assert pl.scan_parquet(store / "routes").select(pl.len()).collect().item() == rows
    glob = (store / "routes" / "**" / "*.parquet").as_posix()
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{glob}')").fetchall() == [(rows,)]
    [part] = sorted((store / "routes").rglob("*.parquet"))
    meta = pq.ParquetFile(part).metadata.metadata
    assert "run_id" not in pq.ParquetFile(part).schema_arrow.names
    assert (meta[b"num_experts"], meta[b"top_k"], meta[b"moe_layer_ids"]) == (b"32", b"4", b"[1, 2, 3, 4]")
