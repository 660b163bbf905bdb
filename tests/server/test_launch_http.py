"""The HTTP server in front of Engine(tp_size=2): the same answers, streams and traces as one process.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_launch_http.py

Two spawned gloo ranks serve the session's tiny checkpoint; the session's one-process engine is the reference.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import duckdb
import httpx
import pytest

from r3trace.engine import Engine
from r3trace.server import ServerConfig, create_app
from tests.server.live_server import LiveServer
from tests.server.sse import sse_events

GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tp2_http(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    engine = Engine(tiny_model, tp_size=2, max_running_requests=16, chunked_prefill_size=256, kv_pool_tokens=4096)
    try:
        cfg = ServerConfig(model_name="tiny-v3", trace_root=tmp_path_factory.mktemp("tp2_traces"))
        with LiveServer(create_app(engine, cfg)) as live, httpx.Client(base_url=live.url, timeout=60) as client:
            yield client
    finally:
        engine.shutdown()


def test_generate_batch_and_stream_match_one_process(tp2_http: httpx.Client, engine: Engine) -> None:
    prompts = [[11, 12, 13, 14], [40, 41, 42], [7, 8, 9, 10, 11, 12]]
    body = {"input_ids": prompts, "sampling_params": GREEDY, "return_routed_experts": True, "return_logprob": True}
    got = tp2_http.post("/generate", json=body).json()
    want = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_routed_experts=True,
                           return_logprob=True)
    assert isinstance(want, list)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["routed_experts"] == w["meta_info"]["routed_experts"]
        for (lg, tg, _), (lw, tw, _) in zip(g["meta_info"]["output_token_logprobs"],
                                           w["meta_info"]["output_token_logprobs"], strict=True):
            assert tg == tw and abs(lg - lw) < 1e-4
    with tp2_http.stream("POST", "/generate", json={"input_ids": prompts[0], "sampling_params": GREEDY,
                                                    "stream": True}) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert chunks[-1]["output_ids"] == want[0]["output_ids"]  # cumulative, as SGLang's default stream


def test_routed_dp_rank_over_http(tp2_http: httpx.Client) -> None:
    ok = tp2_http.post("/generate", json={"input_ids": [3, 4, 5], "sampling_params": GREEDY, "routed_dp_rank": 0})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 5
    bad = tp2_http.post("/generate", json={"input_ids": [3, 4, 5], "sampling_params": GREEDY, "routed_dp_rank": 1})
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "routed_dp_rank" and "1 outside 0..0 (dp_size=1)" in err["message"]


def test_trace_over_http(tp2_http: httpx.Client) -> None:
    assert tp2_http.post("/start_trace", json={"trace_dir": "run-tp2"}).status_code == 200
    outs = tp2_http.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": GREEDY}).json()
    stopped = tp2_http.post("/stop_trace")
    assert stopped.status_code == 200
    reply = stopped.json()
    glob = f"{reply['trace_dir']}/routes/run_id={reply['run_id']}/part-*.parquet"
    con = duckdb.connect()
    counts = dict(con.execute(f"SELECT request_id, count(*) FROM read_parquet('{glob}') GROUP BY 1").fetchall())
    assert counts == {o["meta_info"]["id"]: (len(p) + 5 - 1) * 2
                      for o, p in zip(outs, [[5, 6, 7], [8, 9]], strict=True)}  # 2 MoE layers a position
    assert con.execute(f"SELECT DISTINCT dp_rank FROM read_parquet('{glob}')").fetchall() == [(0,)]
