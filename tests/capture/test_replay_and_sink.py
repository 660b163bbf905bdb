"""Routing replay (R3) and the trace sink.

Run: .venv/bin/pytest -q tests/capture/test_replay_and_sink.py
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pybase64
import pytest

from r3trace.engine import InvalidRequestError
from tests.capture.helpers import returned_routes
from tests.engine.conftest import EngineFactory, greedy, random_prompts

REPO = Path(__file__).resolve().parents[2]


def test_replaying_own_routes_reproduces_logprobs_and_tokens(make_engine: EngineFactory) -> None:
    engine = make_engine()
    p = random_prompts(1, 15, 15, seed=10)[0]
    kw = dict(sampling_params=greedy(8), return_logprob=True, logprob_start_len=0, return_routed_experts=True)
    first = engine.generate(input_ids=p, **kw)
    replayed = engine.generate(input_ids=p, routed_experts=first["meta_info"]["routed_experts"], **kw)
    assert replayed["output_ids"] == first["output_ids"]
    assert replayed["meta_info"]["input_token_logprobs"] == first["meta_info"]["input_token_logprobs"]
    assert replayed["meta_info"]["output_token_logprobs"] == first["meta_info"]["output_token_logprobs"]
    np.testing.assert_array_equal(returned_routes(replayed), returned_routes(first))


def test_replay_forces_different_routes(make_engine: EngineFactory) -> None:
    engine = make_engine()
    p = random_prompts(1, 12, 12, seed=11)[0]
    natural = returned_routes(engine.generate(input_ids=p, sampling_params=greedy(0), return_routed_experts=True))
    forced = natural.copy()
    moe = forced[:, 1:]  # rotate every MoE layer's ids to other experts: a route the gate never picked
    forced[:, 1:] = (moe + 1) % 8
    out = engine.generate(input_ids=p, sampling_params=greedy(0), return_routed_experts=True, routed_experts=forced)
    np.testing.assert_array_equal(returned_routes(out), forced)
    # A partial replay forces only the rows it covers; the rest route freely.
    part = engine.generate(input_ids=p, sampling_params=greedy(0), return_routed_experts=True,
                           routed_experts=forced[:5], routed_experts_replay_start_len=0)
    got = returned_routes(part)
    np.testing.assert_array_equal(got[:5], forced[:5])


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ("not base64!!", "not valid base64"),
        (pybase64.b64encode(np.zeros(7, "<i4").tobytes()).decode(), "not a whole number of rows"),
        (np.zeros((3, 2, 3), np.int32), "shape [3, 2, 3]"),  # wrong layer count
        (np.full((7, 3, 3), 8, np.int32), "expert id 8 outside 0..7"),  # 7 rows: prompt 6 + 2 new - 1
        (np.array([[[-1, -1, -1], [0, 0, 1], [1, 2, 3]]] * 7, np.int32), "repeats"),
        (np.zeros((99, 3, 3), np.int32), "99 rows given; this request computes 7"),
        (np.zeros((2, 3, 3), np.int32), "2 rows given, this request computes 7 (prompt 6 + max_new_tokens 2 - 1)"),
        ("", "0 rows given"),
        (np.zeros((0, 3, 3), np.int32), "0 rows given"),
    ],
)
def test_bad_replay_input_fails_that_request_only(make_engine: EngineFactory, payload: object, needle: str) -> None:
    engine = make_engine()
    prompts = random_prompts(2, 6, 6, seed=12)
    with pytest.raises(InvalidRequestError, match="routed_experts") as info:
        engine.generate(input_ids=prompts[0], sampling_params=greedy(2), routed_experts=payload)
    assert needle in str(info.value)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(2), routed_experts=[payload, None])
    assert needle in outs[0]["error"] and "error" not in outs[1]
    assert len(outs[1]["output_ids"]) == 2


def test_sink_records_every_request_with_provenance(make_engine: EngineFactory, tmp_path: Path) -> None:
    engine = make_engine(page_size=4)
    shared = random_prompts(1, 9, 9, seed=13)[0]
    run_id = engine.start_trace(tmp_path / "trace", run_id="t1")
    a = engine.generate(input_ids=shared + [30], sampling_params=greedy(3), return_routed_experts=True, tag="code")
    b = engine.generate(input_ids=shared + [40, 41], sampling_params=greedy(3), tag="prose")
    manifest = engine.stop_trace()
    assert manifest is not None and manifest["run_id"] == run_id == "t1"
    assert list(manifest["moe_layer_ids"]) == [1, 2] and manifest["top_k"] == 3 and manifest["num_experts"] == 8
    con = duckdb.connect()
    glob = str(tmp_path / "trace" / "**" / "part-*.parquet")
    rows = con.execute(
        f"SELECT request_id, token_pos, layer_id, topk_ids, phase, source FROM read_parquet('{glob}') "
        "ORDER BY request_id, token_pos, layer_id"
    ).fetchall()
    by_req: dict[str, list[tuple]] = {}
    for r in rows:
        by_req.setdefault(r[0], []).append(r)
    ra = by_req[a["meta_info"]["id"]]
    got = np.array([r[3] for r in ra]).reshape(-1, 2, 3)
    np.testing.assert_array_equal(got, returned_routes(a)[:, 1:])
    rb = by_req[b["meta_info"]["id"]]
    assert {r[5] for r in rb if r[1] < 8} == {"prefix_cache"} and {r[5] for r in rb if r[1] >= 8} == {"computed"}
    assert {r[4] for r in rb if r[1] >= len(shared) + 2} == {"decode"}
    assert len(rb) == 2 * (len(shared) + 2 + 2)  # rows = seq_len - 1, two MoE layers each
    requests_glob = f"{tmp_path}/trace/**/requests-*.parquet"
    tags = dict(con.execute(f"SELECT request_id, tag FROM read_parquet('{requests_glob}')").fetchall())
    assert tags == {a["meta_info"]["id"]: "code", b["meta_info"]["id"]: "prose"}


def test_arrow_ipc_stream_carries_the_same_rows(make_engine: EngineFactory, tmp_path: Path) -> None:
    import pyarrow as pa

    from r3trace.trace.stream import read_stream

    engine = make_engine()
    engine.start_trace(tmp_path / "trace", run_id="s1", stream_to=str(tmp_path / "routes.arrows"))
    engine.generate(input_ids=random_prompts(3, 4, 9, seed=14), sampling_params=greedy(4))
    engine.stop_trace()
    manifest, batches = read_stream(str(tmp_path / "routes.arrows"))
    streamed = pa.Table.from_batches(list(batches))
    assert manifest.run_id == "s1" and list(manifest.moe_layer_ids) == [1, 2]
    parquet = pq.read_table(next((tmp_path / "trace" / "routes" / "run_id=s1").glob("part-*.parquet")))
    key = ["request_id", "token_pos", "layer_id"]
    a = streamed.select([*key, "topk_ids"]).sort_by([(k, "ascending") for k in key]).to_pylist()
    b = parquet.select([*key, "topk_ids"]).sort_by([(k, "ascending") for k in key]).to_pylist()
    assert a == b and len(a) > 0


def test_sink_under_preemption_has_each_row_once_and_exact(tiny_ckpt: Path, make_engine: EngineFactory,
                                                          tmp_path: Path) -> None:
    """Retracted requests are re-prefilled; the trace keeps the first computation of every position and
    never writes a (request, position, layer) twice."""
    from tests.capture.helpers import direct_routes

    engine = make_engine(kv_pool_tokens=64, chunked_prefill_size=16)
    engine.start_trace(tmp_path / "trace", run_id="p")
    prompts = random_prompts(5, 8, 14, seed=4)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(12))
    engine.stop_trace()
    assert engine.scheduler.num_retractions > 0
    con = duckdb.connect()
    glob = str(tmp_path / "trace" / "**" / "part-*.parquet")
    dup = con.execute(f"SELECT count(*) FROM (SELECT request_id, token_pos, layer_id, count(*) c "
                      f"FROM read_parquet('{glob}') GROUP BY ALL HAVING c > 1)").fetchone()
    assert dup == (0,)
    for p, o in zip(prompts, outs, strict=True):
        rows = con.execute(f"SELECT token_pos, layer_id, topk_ids FROM read_parquet('{glob}') "
                           "WHERE request_id = ? ORDER BY token_pos, layer_id", [o["meta_info"]["id"]]).fetchall()
        seq = p + o["output_ids"]
        want = direct_routes(tiny_ckpt, seq[:-1])
        got = np.array([r[2] for r in rows]).reshape(len(seq) - 1, 2, 3)
        np.testing.assert_array_equal(got, want[:, 1:])
