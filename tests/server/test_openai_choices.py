"""Several choices per request (`n`, lists of prompts) on /v1/completions, /v1/chat/completions and /generate, on
the bundled sample model: each choice an engine request of its own, seeded choices reproducible one by one, routes
per choice, streams tagged by index, usage once per prompt.

Contracts, as read from their sources (nothing copied):
- sgl-project/sglang python/sglang/srt/managers/io_struct.py @ 001067fffe33427bee0ed2f007fb7551a1d76b44
  (GenerateReqInput._handle_parallel_sampling): n comes from sampling_params, the same in every entry of a list
  ("The parallel_sample_num should be the same for all samples"); a single prompt with n > 1 becomes a batch.
- tokenizer_manager_components/batch_request_dispatcher.py @ 135b6ceae5d2cb5072d0cb05a875bbedff00e300: choices
  prompt-major (for each prompt, n copies), each copy's sampling params shared, so one seed for all n;
  response_emitter.py @ 5bf23cf6bf992f5b2f35b9e92cc1fb3f3422ff49: a whole answer is the list of results, a stream
  sets each chunk's `index` to its place in that list.
- vllm-project/vllm vllm/v1/engine/parallel_sampling.py @ 003d3ee22261b7937258b7531aee00e10393f1d6: a seeded
  parent's child j samples with seed + j; r3trace takes this rule (SGLang's n seeded choices are one text n times).
- entrypoints/openai/serving_completions.py @ 004c82e07d876f6e4a0ad6e15325706b0f478f1a: echo of choice idx is prompt
  idx // n; `sglext` holds the first result's routes; usage_processor.py @
  056c7ec2bdc0f1ddaf4d255a0076501a742c34bc: prompt tokens once per prompt (every n-th result), completion tokens of
  every choice.
- managers/scheduler.py @ 0003215cf1464f44b389cd0b18d0b4c56f2a3da6: a routed_experts_start_len over the prompt is
  refused with "... is higher than the number of input tokens ...".
- openai-python src/openai/types/chat/chat_completion_stream_options_param.py @
  2a4f5d19bddf37e433786d3e8abfe2567bcf8234: with include_usage "all other chunks will also include a usage field,
  but with a null value".

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_openai_choices.py
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import httpx
import numpy as np
import pytest

from r3trace import decode_routed_experts
from r3trace.engine import Engine
from r3trace.server.choices import choice_seed
from tests.server.sse import stream_json

PROMPT = "def fib(n):"
SAMPLED = {"temperature": 1.0, "ignore_eos": True}
SEED = 11
NEW = 6


def _alone(engine: Engine, seed: int, prompt: str = PROMPT, **kw: Any) -> dict[str, Any]:
    out = engine.generate(prompt=prompt, sampling_params={**SAMPLED, "max_new_tokens": NEW, "seed": seed}, **kw)
    assert isinstance(out, dict)
    return out


def test_seeded_choices_equal_separate_seeded_requests(sample_http: httpx.Client, sample_engine: Engine) -> None:
    """Choice j of n=3 seeded with s is the lone request seeded with s + j, on both OpenAI endpoints."""
    body = {"prompt": PROMPT, "max_tokens": NEW, "n": 3, "seed": SEED, **SAMPLED}
    texts = [c["text"] for c in sample_http.post("/v1/completions", json=body).json()["choices"]]
    assert texts == [_alone(sample_engine, SEED + j)["text"] for j in range(3)]
    assert texts == [sample_http.post("/v1/completions", json={**body, "n": 1, "seed": SEED + j}).json()
                     ["choices"][0]["text"] for j in range(3)]
    assert len(set(texts)) > 1, "seeds must differ between choices"
    chat = {"messages": [{"role": "user", "content": "fib?"}], "max_tokens": NEW, "seed": SEED, **SAMPLED}
    got = sample_http.post("/v1/chat/completions", json={**chat, "n": 3}).json()["choices"]
    assert [c["index"] for c in got] == [0, 1, 2]
    assert [c["message"]["content"] for c in got] == [
        sample_http.post("/v1/chat/completions", json={**chat, "seed": SEED + j}).json()["choices"][0]["message"]
        ["content"] for j in range(3)]
    assert choice_seed(2**63 - 1, 1) == 0  # seeds stay in the engine's range [0, 2**63)


def test_generate_n_is_sglang_parallel_sampling(sample_http: httpx.Client, sample_engine: Engine) -> None:
    """/generate sampling_params.n: a list of results, prompt-major; rids <rid>.<j>."""
    sp = {**SAMPLED, "max_new_tokens": NEW, "seed": SEED, "n": 3}
    out = sample_http.post("/generate", json={"text": PROMPT, "sampling_params": sp, "rid": "fib"}).json()
    assert isinstance(out, list) and [r["meta_info"]["id"] for r in out] == ["fib.0", "fib.1", "fib.2"]
    assert [r["output_ids"] for r in out] == [_alone(sample_engine, SEED + j)["output_ids"] for j in range(3)]
    prompts = [PROMPT, "import numpy"]
    both = sample_http.post("/generate", json={"text": prompts, "sampling_params": {**sp, "n": 2}}).json()
    assert [r["output_ids"] for r in both] == [_alone(sample_engine, SEED + j, p)["output_ids"]
                                               for p in prompts for j in range(2)]


def test_streams_carry_each_choice_index(sample_http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": NEW, "n": 3, "seed": SEED, **SAMPLED}
    whole = sample_http.post("/v1/completions", json=body).json()["choices"]
    text: dict[int, str] = defaultdict(str)
    finished: dict[int, int] = defaultdict(int)
    for chunk in stream_json(sample_http, "/v1/completions", body):
        [c] = chunk["choices"]
        text[c["index"]] += c["text"]
        finished[c["index"]] += c["finish_reason"] is not None
    assert dict(text) == {c["index"]: c["text"] for c in whole}
    assert dict(finished) == {0: 1, 1: 1, 2: 1}
    chat = {"messages": [{"role": "user", "content": "fib?"}], "max_tokens": NEW, "n": 2, "seed": SEED, **SAMPLED}
    roles = [c["choices"][0]["index"] for c in stream_json(sample_http, "/v1/chat/completions", chat)
             if "role" in c["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1]  # each choice's first chunk names the role
    sp = {**SAMPLED, "max_new_tokens": NEW, "seed": SEED, "n": 2}
    results = sample_http.post("/generate", json={"text": PROMPT, "sampling_params": sp}).json()
    last = {c["index"]: c for c in stream_json(sample_http, "/generate", {"text": PROMPT, "sampling_params": sp})}
    assert [last[i]["output_ids"] for i in range(2)] == [r["output_ids"] for r in results]  # cumulative chunks
    batch = {"text": [PROMPT, "import numpy"], "sampling_params": {**sp, "n": 1}}  # a list streams too, as SGLang's
    results = sample_http.post("/generate", json=batch).json()
    last = {c["index"]: c for c in stream_json(sample_http, "/generate", batch)}
    assert [last[i]["output_ids"] for i in range(2)] == [r["output_ids"] for r in results]


def test_routes_of_every_choice(sample_http: httpx.Client, sample_engine: Engine) -> None:
    """sglext holds choice 0's routes (SGLang's reader), sglext.choices[i] each choice's; streamed, the same once."""
    body = {"prompt": PROMPT, "max_tokens": NEW, "n": 2, "seed": SEED, "return_routed_experts": True, **SAMPLED}
    ext = sample_http.post("/v1/completions", json=body).json()["sglext"]
    want = [_alone(sample_engine, SEED + j, return_routed_experts=True)["meta_info"] for j in range(2)]
    assert ext["routed_experts"] == want[0]["routed_experts"]
    for j in range(2):
        assert ext["choices"][j]["index"] == j
        np.testing.assert_array_equal(decode_routed_experts(ext["choices"][j]), decode_routed_experts(want[j]))
    events = stream_json(sample_http, "/v1/completions", body)
    with_routes = [i for i, e in enumerate(events) if "sglext" in e]
    assert with_routes == [len(events) - 1] and events[-1]["choices"] == []
    streamed = events[-1]["sglext"]
    for j in range(2):
        np.testing.assert_array_equal(decode_routed_experts(streamed["choices"][j]), decode_routed_experts(want[j]))
        assert "routed_experts_offset" not in streamed["choices"][j]


def test_usage_counts_each_prompt_once_and_echo_picks_its_prompt(sample_http: httpx.Client) -> None:
    prompts = [PROMPT, "import numpy as np"]
    body = {"prompt": prompts, "max_tokens": 3, "n": 2, "seed": SEED, "echo": True, **SAMPLED}
    out = sample_http.post("/v1/completions", json=body).json()
    singles = [sample_http.post("/v1/completions", json={**body, "prompt": p, "n": 1}).json()["usage"]
               for p in prompts]
    assert out["usage"]["prompt_tokens"] == sum(u["prompt_tokens"] for u in singles)
    assert out["usage"]["completion_tokens"] == 2 * 2 * 3
    assert [c["text"].startswith(prompts[c["index"] // 2]) for c in out["choices"]] == [True] * 4
    events = stream_json(sample_http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"] == out["usage"] and events[-1]["choices"] == []
    assert all(e["usage"] is None for e in events[:-1])


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_start_len_over_the_prompt_in_sglang_words(sample_http: httpx.Client, path: str) -> None:
    body: dict[str, Any] = {"return_routed_experts": True, "routed_experts_start_len": 500}
    body |= {"/generate": {"text": PROMPT}, "/v1/completions": {"prompt": PROMPT},
             "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}[path]
    r = sample_http.post(path, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "routed_experts_start_len"
    assert "500 is higher than the number of input tokens" in err["message"], err


def test_continuous_usage_stats(sample_http: httpx.Client) -> None:
    """SGLang's stream_options.continuous_usage_stats (serving_completions.py @ 004c82e: each chunk the usage of its
    choice so far): completion_tokens count up to max_tokens per choice."""
    body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, "seed": SEED, **SAMPLED,
            "stream_options": {"continuous_usage_stats": True}}
    seen: dict[int, list[int]] = defaultdict(list)
    for e in stream_json(sample_http, "/v1/completions", body):
        [c] = e["choices"]
        seen[c["index"]].append(e["usage"]["completion_tokens"])
        assert e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + seen[c["index"]][-1]
    assert {i: v[-1] for i, v in seen.items()} == {0: 4, 1: 4}
    assert all(v == sorted(v) for v in seen.values())


def test_a_client_leaving_a_stream_aborts_every_choice(sample_http: httpx.Client, sample_engine: Engine) -> None:
    """End to end over HTTP: the engine is idle within 5 s of the client closing the stream after its first event
    (measured 0.07 s at load average 9 on 2 cores) only if both choices' requests were aborted; running on, they
    take ~30 s (2 x 1000 tokens). The race behind a late abort (closing an engine stream while a worker thread reads
    it) is tested deterministically in tests/server/test_choices.py."""
    body = {"prompt": PROMPT, "max_tokens": 1000, "n": 2, "ignore_eos": True, "stream": True}
    with sample_http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 5.0
    while not sample_engine.flush_cache():  # True only when no request is in flight
        assert time.monotonic() < deadline, "the choices kept generating after the client left"
        time.sleep(0.05)
    assert sample_http.get("/health").json()["in_flight"] == 0
