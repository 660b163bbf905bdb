"""The endpoints over real HTTP on loopback: /generate (JSON, batch, SSE), OpenAI, health, metrics, spec.

Run: .venv/bin/pytest -q tests/server/test_endpoints.py
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np

from r3trace import decode_routed_experts
from r3trace.engine import Engine
from tests.server.sse import sse_events

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_generate_matches_engine(http: httpx.Client, engine: Engine) -> None:
    body = {"input_ids": [11, 12, 13, 14], "sampling_params": GREEDY}
    r = http.post("/generate", json=body)
    assert r.status_code == 200
    got = r.json()
    direct = engine.generate(input_ids=[11, 12, 13, 14], sampling_params=GREEDY)
    assert isinstance(direct, dict)
    assert got["output_ids"] == direct["output_ids"]
    assert got["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert got["meta_info"]["prompt_tokens"] == 4 and got["meta_info"]["completion_tokens"] == 4


def test_generate_batch_and_logprobs(http: httpx.Client) -> None:
    body = {"input_ids": [[3, 4, 5], [6, 7]], "sampling_params": GREEDY, "return_logprob": True}
    r = http.post("/generate", json=body)
    assert r.status_code == 200
    out = r.json()
    assert isinstance(out, list) and len(out) == 2
    assert [len(o["meta_info"]["output_token_logprobs"]) for o in out] == [4, 4]


def test_stream_sse_concatenates_to_the_whole(http: httpx.Client) -> None:
    body = {"input_ids": [21, 22, 23], "sampling_params": {**GREEDY, "max_new_tokens": 5}}
    whole = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["output_ids"] == whole["output_ids"]  # each chunk the whole output so far, as SGLang's
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_completions_and_chat(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": [31, 32, 33], "max_tokens": 3, "temperature": 0,
                                               "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert out["choices"][0]["finish_reason"] == "length"
    hi = [{"role": "user", "content": "hi"}]
    r = http.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 2})
    assert r.status_code == 200, r.text
    chat = r.json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["prompt_tokens"] == len(b"user: hi\nassistant:")  # fallback template, byte tokenizer
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as s:
        events = sse_events(s)
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_health_models_and_metrics(http: httpx.Client) -> None:
    assert http.get("/health").json()["status"] == "ok"
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny-v3"
    before = http.get("/metrics").text
    http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": GREEDY})
    text = http.get("/metrics").text

    def value(page: str, series: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(series))

    def delta(series: str) -> float:
        return value(text, series) - value(before, series)

    assert delta("r3trace_completion_tokens_total") == 4
    assert delta("r3trace_prompt_tokens_total") == 3
    ok = 'r3trace_requests_total{model="tiny-v3",endpoint="/generate",status="200"}'
    assert value(text, ok) == value(before, ok) + 1
    for series in ("r3trace_capture_bytes_total", "r3trace_queue_depth", "# TYPE r3trace_queue_depth gauge"):
        assert series in text


def test_openapi_spec_matches(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/start_trace", "/stop_trace"):
        assert "post" in spec["paths"][path], path
    schemas = spec["components"]["schemas"]
    gen = schemas["GenerateRequest"]
    assert gen["additionalProperties"] is False
    assert {"text", "input_ids", "sampling_params", "return_routed_experts", "routed_experts_start_len",
            "stream"} <= set(gen["properties"])
    assert schemas["SamplingParamsBody"]["additionalProperties"] is False
    assert "4XX" in spec["paths"]["/generate"]["post"]["responses"]
    # the spec's sampling fields are the engine's: nothing the engine would refuse, nothing missing (n, SGLang's
    # parallel sampling, is the server's: it makes n engine requests; SamplingExtras are SGLang's fields the server
    # ignores or refuses itself, never passed on)
    from dataclasses import fields

    from r3trace.engine import SamplingParams
    from r3trace.server.request_extras import SamplingExtras
    engine_fields = {f.name for f in fields(SamplingParams)} | {"sampling_seed"}
    assert not engine_fields & set(SamplingExtras.model_fields)
    assert set(schemas["SamplingParamsBody"]["properties"]) == engine_fields | {"n", *SamplingExtras.model_fields}
    # a real response has only fields the spec declares
    out = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": GREEDY}).json()
    assert set(out) <= set(schemas["GenerateResponse"]["properties"])
    assert set(out["meta_info"]) <= set(schemas["MetaInfo"]["properties"])


def test_trace_endpoints(http: httpx.Client, trace_root: Path) -> None:
    r = http.post("/stop_trace")
    assert r.status_code in (409, 501), r.text  # nothing is being recorded
    r = http.post("/start_trace", json={"trace_dir": "run-a"})
    if r.status_code == 501:
        assert "start_trace" in r.json()["error"]["message"]
        return
    assert r.status_code == 200, r.text
    assert http.post("/start_trace", json={"trace_dir": "run-b"}).status_code == 409
    http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": GREEDY})
    r = http.post("/stop_trace")
    assert r.status_code == 200 and not r.json()["tracing"]
    assert any((trace_root / "run-a").rglob("manifest.json"))


def test_generate_routes_and_start_len(http: httpx.Client, engine: Engine) -> None:
    ids = [41, 42, 43, 44, 45]
    body = {"input_ids": ids, "sampling_params": GREEDY, "return_routed_experts": True}
    out = http.post("/generate", json=body).json()
    routes = decode_routed_experts(out["meta_info"])
    layers = engine.model_config.num_hidden_layers
    assert routes.shape[0] == len(ids) + 4 - 1 and routes.shape[1] == layers
    cut = http.post("/generate", json={**body, "routed_experts_start_len": 2}).json()
    np.testing.assert_array_equal(decode_routed_experts(cut["meta_info"]), routes[2:])
    r = http.post("/generate", json={**body, "routed_experts_start_len": len(ids) + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "routed_experts_start_len"


def test_streamed_routes_add_up(http: httpx.Client) -> None:
    body = {"input_ids": [51, 52, 53], "sampling_params": {**GREEDY, "max_new_tokens": 5},
            "return_routed_experts": True}
    whole = decode_routed_experts(http.post("/generate", json=body).json()["meta_info"])
    with http.stream("POST", "/generate", json={**body, "stream": True, "incremental_streaming_output": True}) as r:
        events = sse_events(r)
    parts = [decode_routed_experts(m) for m in (json.loads(e)["meta_info"] for e in events[:-1])
             if m.get("routed_experts")]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_openai_sglext_routes(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={
        "prompt": [61, 62, 63], "max_tokens": 3, "temperature": 0, "return_routed_experts": True})
    ext = r.json()["sglext"]  # response level, as SGLang's (tests/server/test_sglang_routes.py)
    assert decode_routed_experts(ext).shape[0] == 3 + 3 - 1
