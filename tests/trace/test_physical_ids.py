"""The routes' physical_ids column (with_physical_ids): the writer's checks, the Parquet and stream round trip, the
rollup on logical ids, and the multi-rank forwarder's pickling path.

    TRITON_INTERPRET=1 .venv/bin/pytest -q tests/trace/test_physical_ids.py
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

from r3trace.engine.launch.lockstep import TraceForwarder
from r3trace.trace import Manifest, TraceSchemaError, TraceStreamWriter, TraceWriter, read_stream

MOE = [1, 2, 4]  # L = 3 MoE layers of 5
E, P, K, T = 16, 20, 4, 6


def writer(root: Path, **kw: Any) -> TraceWriter:
    return TraceWriter(root, model_name="t", num_hidden_layers=5, moe_layer_ids=MOE, num_experts=E, top_k=K,
                       run_id="a", flush_interval_s=None, **kw)


def routes(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """topk_ids [T, L, K] and physical_ids [T, L, K]: slot p holds expert p % E."""
    rng = np.random.default_rng(seed)
    phys = np.stack([rng.permutation(P)[:K] for _ in range(T * len(MOE))]).reshape(T, len(MOE), K)
    return (phys % E).astype(np.int32), phys.astype(np.int64)


def append(w: Any, ids: np.ndarray, **kw: Any) -> None:
    w.append_tokens(["r"] * T, np.arange(T), "decode", "computed", 0, 0, 0, ids, **kw)


def test_missing_or_misshapen_physical_ids_are_refused(tmp_path: Path) -> None:
    ids, phys = routes(0)
    w = writer(tmp_path, with_physical_ids=True)
    with pytest.raises(TraceSchemaError, match="column physical_ids is missing, manifest says with_physical_ids"):
        append(w, ids)
    with pytest.raises(TraceSchemaError, match=r"column physical_ids has shape \(6, 3, 3\), expected \(6, 3, 4\)"):
        append(w, ids, physical_ids=phys[..., :3])
    with pytest.raises(TraceSchemaError, match="column physical_ids holds -1"):
        append(w, ids, physical_ids=np.full_like(phys, -1))
    with pytest.raises(TraceSchemaError, match="column physical_ids is missing"):  # the row-level append too
        w.append("r", 0, "decode", "computed", 0, 0, 0, MOE[0], ids[0, :1])
    assert w.close().rows == 0  # nothing refused was buffered
    plain = writer(tmp_path / "plain")  # without the option, physical_ids are ignored and no column is written
    append(plain, ids, physical_ids=phys)
    plain.close()
    cols = duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet('{tmp_path}/plain/routes/**/*.parquet')").fetchall()
    assert "physical_ids" not in [c[0] for c in cols]


def test_physical_ids_round_trip_parquet_and_stream(tmp_path: Path) -> None:
    ids, phys = routes(1)
    w = writer(tmp_path, with_physical_ids=True, rows_per_file=T * len(MOE))
    append(w, ids, physical_ids=phys)
    w.append(["r"] * 2, [T, T], "decode", "computed", 1, 0, 0, MOE[:2], ids[0, :2], physical_ids=phys[0, :2])
    m = w.close()
    assert m.with_physical_ids and m.rows == T * len(MOE) + 2
    assert Manifest.read(tmp_path / "run_id=a").with_physical_ids
    got = duckdb.sql(f"SELECT token_pos, layer_id, topk_ids, physical_ids FROM read_parquet("
                     f"'{tmp_path}/routes/**/*.parquet') ORDER BY token_pos, layer_id").fetchall()
    want_ids = np.concatenate([ids.reshape(-1, K), ids[0, :2]])
    want_phys = np.concatenate([phys.reshape(-1, K), phys[0, :2]])
    assert np.array_equal(np.array([r[2] for r in got]), want_ids)
    assert np.array_equal(np.array([r[3] for r in got]), want_phys)
    # the rollup counts logical ids: one entry per topk_ids entry, none of them >= E
    roll = duckdb.sql(f"SELECT max(expert_id), sum(count) FROM read_parquet('{tmp_path}/rollups/**/*.parquet')")
    assert roll.fetchall() == [(int(want_ids.max()), want_ids.size)]

    buf = io.BytesIO()
    with TraceStreamWriter(buf, m) as s:
        append(s, ids, physical_ids=phys)
        with pytest.raises(TraceSchemaError, match="column physical_ids is missing"):
            append(s, ids)
    manifest, batches = read_stream(io.BytesIO(buf.getvalue()))
    table = next(batches)
    assert manifest.with_physical_ids
    assert np.array_equal(np.array(table.column("physical_ids").to_pylist()), phys.reshape(-1, K))


def test_old_manifest_reads_without_physical_ids(tmp_path: Path) -> None:
    m = writer(tmp_path).close()
    d = json.loads(m.to_json())
    del d["with_physical_ids"]  # a manifest written before the field existed
    assert Manifest.from_dict(d).with_physical_ids is False


def test_forwarder_keeps_physical_ids_through_pickling(tmp_path: Path) -> None:
    """The rank side of a multi-rank engine (lockstep.TraceForwarder) pickles each call to the front end's writer
    (group.py: sink.append_tokens(*item[1], **item[2])); the physical_ids keyword must arrive as it left."""
    ids, phys = routes(2)
    outbox: list[Any] = []
    TraceForwarder(outbox, reporting=True, dp_rank=1).append_tokens(
        ["r"] * T, np.arange(T), "decode", "computed", 0, 0, 0, ids, None, physical_ids=phys)
    kind, args, kw = pickle.loads(pickle.dumps(outbox[0]))
    assert kind == "rows"
    w = writer(tmp_path, with_physical_ids=True)
    w.append_tokens(*args, **kw)
    w.close()
    got = duckdb.sql(f"SELECT dp_rank, physical_ids FROM read_parquet('{tmp_path}/routes/**/*.parquet')"
                     " ORDER BY token_pos, layer_id").fetchall()
    assert {r[0] for r in got} == {1}
    assert np.array_equal(np.array([r[1] for r in got]), phys.reshape(-1, K))
