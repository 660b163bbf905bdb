"""TraceWriter / readers round trip. Run: .venv/bin/pytest tests/analysis/test_trace_writer.py -q"""

from __future__ import annotations

import io
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest

from r3trace.trace import (
    Manifest,
    TraceSchemaError,
    TraceStreamWriter,
    TraceWriter,
    open_dataset,
    read_stream,
    read_token_routes,
)
from tests.analysis.conftest import MOE, E, K


def test_roundtrip_rows_files_manifest(tiny_trace: dict) -> None:
    root: Path = tiny_trace["root"]
    ids = tiny_trace["ids"]
    run = open_dataset(root)[0]
    m = run.manifest
    assert m.rows == ids.shape[0] * len(MOE)
    assert m.file_count == len(list((root / "routes" / "run_id=a").glob("part-*.parquet"))) > 1
    assert sum(pq.read_metadata(p).num_rows for p in run.route_files) == m.rows
    schema = pq.read_schema(run.route_files[0])
    t = schema.field("topk_ids").type
    assert t.list_size == K and str(t.value_type) == "int32"
    assert "run_id" not in schema.names  # the partition: in the path (routes/run_id=a), not in the file
    back = read_token_routes(run)
    assert np.array_equal(back.topk_ids, ids)
    assert list(back.request_id) == list(tiny_trace["req"])
    # rollups hold exactly the heat of the rows
    c = duckdb.connect()
    files = [str(p) for p in run.rollup_files]
    roll = c.sql(f"select layer_id, expert_id, sum(count) from read_parquet({files}) group by all").fetchall()
    heat = {(MOE[li], e): 0 for li in range(len(MOE)) for e in range(E)}
    for li in range(len(MOE)):
        for e, n in zip(*np.unique(ids[:, li], return_counts=True), strict=True):
            heat[(MOE[li], int(e))] = int(n)
    assert {(int(a), int(b)): int(n) for a, b, n in roll} == {k: v for k, v in heat.items() if v}
    reqs = c.sql(f"select request_id, tag from read_parquet({[str(p) for p in run.request_files]})").fetchall()
    assert dict(reqs) == tiny_trace["tags"]
    assert Manifest.read(root / "run_id=a") == m


def test_bad_input_is_refused_with_field_names(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path, model_name="t", num_hidden_layers=5, moe_layer_ids=MOE, num_experts=E, top_k=K)
    ids = np.zeros((2, len(MOE), K), dtype=np.int32)
    with pytest.raises(TraceSchemaError, match="topk_ids has 3 entries per layer, manifest says 4"):
        w.append_tokens(["r", "r"], [0, 1], "decode", "computed", 0, 0, 0, ids[..., :3])
    bad = ids.copy()
    bad[1, 2, 0] = E
    with pytest.raises(TraceSchemaError, match="topk_ids holds 16, outside 0..15"):
        w.append_tokens(["r", "r"], [0, 1], "decode", "computed", 0, 0, 0, bad)
    with pytest.raises(TraceSchemaError, match="phase value 'warmup'"):
        w.append_tokens(["r", "r"], [0, 1], "warmup", "computed", 0, 0, 0, ids)
    with pytest.raises(TraceSchemaError, match="layer_id holds 3"):
        w.append(["r"], [0], "decode", "computed", 0, 0, 0, [3], ids[0, :1])
    assert w.close().rows == 0


def test_ipc_stream_roundtrip() -> None:
    rng = np.random.default_rng(5)
    m = Manifest(run_id="s", model_name="t", num_hidden_layers=5, moe_layer_ids=MOE, num_experts=E, top_k=K)
    buf = io.BytesIO()
    ids = rng.integers(0, E, (7, len(MOE), K)).astype(np.int32)
    with TraceStreamWriter(buf, m) as s:
        s.append_tokens("r0", np.arange(7), "decode", "computed", 3, 0, 1, ids)
        s.append_tokens("r1", np.arange(7), "prefill", "prefix_cache", 4, 0, 1, ids[::-1])
    buf.seek(0)
    m2, batches = read_stream(buf)
    got = [b for b in batches]
    assert m2 == m and [b.num_rows for b in got] == [21, 21]
    flat = np.asarray(got[1].column("topk_ids").flatten()).reshape(7, len(MOE), K)
    assert np.array_equal(flat, ids[::-1])
