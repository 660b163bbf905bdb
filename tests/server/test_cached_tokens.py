"""Prefix-cache hits reported as SGLang reports them: meta_info.cached_tokens_details, OpenAI's
return_cached_tokens_details and --enable-cache-report.

The contract, read (not copied) from sgl-project/sglang:
- entrypoints/openai/protocol.py at 004c82e07d876f6e4a0ad6e15325706b0f478f1a: `return_cached_tokens_details: bool`
  on CompletionRequest and ChatCompletionRequest; `SglExt.cached_tokens_details` a CachedTokensDetails
  {device, host} (storage fields only with an L3 tier); UsageInfo.prompt_tokens_details {cached_tokens};
- entrypoints/openai/utils.py at 0101654f9cc8d059f1c0914628f00a8cee65f9e0 (process_cached_tokens_details_from_ret):
  the block only when the request asked and meta_info has `cached_tokens_details`;
- entrypoints/openai/serving_chat.py at 002897c23becbd522d88b8115a763a21765f978a: whole answers read the first
  result's; streams send it in the `choices: []` sglext chunk, beside the routes;
- entrypoints/openai/usage_processor.py at 056c7ec2bdc0f1ddaf4d255a0076501a742c34bc: with enable_cache_report,
  prompt_tokens_details = {cached_tokens: each prompt's cached tokens once} when that sum is > 0, else absent;
- managers/scheduler_output_processor_mixin.py (_get_cached_tokens_details, the version without a HiCache check):
  no host or storage tier: {"device": cached_tokens, "host": 0} once any token hit, else no key.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_cached_tokens.py
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from r3trace.engine import Engine
from r3trace.server import ServerConfig, create_app
from tests.server.live_server import LiveServer
from tests.server.sse import json_events

GREEDY = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture()
def cold(engine: Engine) -> None:
    """An empty prefix cache: the session's server is shared with other files' tests, and any cached prompt with this
    test's first token would make its cold request hit (under pytest-xdist their order is not the files' order)."""
    assert engine.flush_cache()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 250) for _ in range(40)]


def _warm(http: httpx.Client, ids: list[int]) -> int:
    """Send the prompt twice to /generate; the second's cached_tokens (> 0), checked against its details."""
    first = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()["meta_info"]
    assert first["cached_tokens"] == 0 and "cached_tokens_details" not in first
    again = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()["meta_info"]
    hit = again["cached_tokens"]
    assert hit > 0 and again["cached_tokens_details"] == {"device": hit, "host": 0}
    return int(hit)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sglext_cached_tokens_details(http: httpx.Client, path: str, cold: None) -> None:
    if path == "/v1/completions":
        ids = _prompt(41)
        body: dict[str, Any] = {"prompt": ids, "max_tokens": 3, "temperature": 0}
    else:
        ids = _prompt(42)
        body = {"messages": [{"role": "user", "content": "x"}], "input_ids": ids, "max_tokens": 3, "temperature": 0}
    hit = _warm(http, ids)
    plain = http.post(path, json=body).json()
    assert "sglext" not in plain  # not asked: no block, as SGLang
    asked = http.post(path, json={**body, "return_cached_tokens_details": True}).json()
    assert asked["sglext"] == {"cached_tokens_details": {"device": hit, "host": 0}}
    assert "prompt_tokens_details" not in asked["usage"]  # --enable-cache-report is off
    with http.stream("POST", path, json={**body, "return_cached_tokens_details": True, "stream": True}) as r:
        events = json_events(r)
    tail = [e for e in events if "sglext" in e]
    assert len(tail) == 1 and tail[0]["choices"] == [] and events[-1] is tail[0]
    assert tail[0]["sglext"] == {"cached_tokens_details": {"device": hit, "host": 0}}


def test_cached_tokens_details_beside_routes(http: httpx.Client, cold: None) -> None:
    """A capturing request reuses only a prefix cached with its routes: the second of two identical ones hits."""
    ids = _prompt(43)
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "return_routed_experts": True,
            "return_cached_tokens_details": True}
    cold = http.post("/v1/completions", json=body).json()
    assert "cached_tokens_details" not in cold["sglext"]  # no hit, no breakdown
    out = http.post("/v1/completions", json=body).json()
    hit = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY,
                                       "return_routed_experts": True}).json()["meta_info"]["cached_tokens"]
    assert hit > 0 and out["sglext"]["cached_tokens_details"] == {"device": hit, "host": 0}
    assert isinstance(out["sglext"]["routed_experts"], str)


def test_enable_cache_report_fills_usage(engine: Engine, cold: None) -> None:
    cfg = ServerConfig(model_name="tiny-v3", enable_cache_report=True)
    with LiveServer(create_app(engine, cfg)) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        ids = _prompt(44)
        body = {"prompt": ids, "max_tokens": 2, "temperature": 0}
        cold = http.post("/v1/completions", json=body).json()["usage"]
        assert "prompt_tokens_details" not in cold  # no hit: absent (SGLang's _details_if_cached)
        hit = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()["meta_info"][
            "cached_tokens"]
        assert hit > 0
        warm = http.post("/v1/completions", json={**body, "n": 2}).json()["usage"]
        assert warm["prompt_tokens_details"] == {"cached_tokens": hit}  # the prompt's hits once, not per choice
        with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as r:
            last = json_events(r)[-1]
        assert last["choices"] == [] and last["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}
