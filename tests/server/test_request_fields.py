"""Fields real SGLang clients send to /generate are accepted and give the same tokens; what cannot be served is a
400 naming the field.

The contract, read (not copied) from sgl-project/sglang: python/sglang/srt/managers/io_struct.py at
001067fffe33427bee0ed2f007fb7551a1d76b44 (GenerateReqInput: extra_key, priority, lora_path, custom_logit_processor,
return_hidden_states, return_text_in_logprobs; no top-level max_new_tokens, which r3trace honours as a default),
python/sglang/srt/sampling/sampling_params.py at 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03 (SamplingParams:
skip_special_tokens, spaces_between_special_tokens, no_stop_trim, sampling_seed). slime's rollout body is the
field list of issue 23 point 2 (slime's own source was not found in the code index): skip_special_tokens,
no_stop_trim and spaces_between_special_tokens in sampling_params, with return_routed_experts.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_request_fields.py
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.sse import stream_json

PROMPT = [5, 6, 7, 8]
GREEDY = {"max_new_tokens": 4, "temperature": 0}
MINIMAL = {"input_ids": PROMPT, "sampling_params": GREEDY}


def _tokens(http: httpx.Client, body: dict[str, Any]) -> list[int]:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


SLIME = {
    "input_ids": PROMPT,
    "sampling_params": {**GREEDY, "top_p": 1.0, "top_k": -1, "stop": None, "stop_token_ids": None,
                        "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False},
    "return_logprob": True,
    "return_routed_experts": True,
}


@pytest.mark.parametrize(("case", "body"), [
    ("slime rollout", SLIME),
    ("sglang top-level max_new_tokens", {"input_ids": PROMPT, "max_new_tokens": 4,
                                         "sampling_params": {"temperature": 0}}),
    ("sglang extra_key", {**MINIMAL, "extra_key": "tenant-a"}),
    ("accepted-and-ignored", {**MINIMAL, "priority": 3, "return_hidden_states": False,
                              "return_text_in_logprobs": True, "custom_logit_processor": None, "lora_path": None}),
    ("sampling_seed alias", {"input_ids": PROMPT, "sampling_params": {**GREEDY, "sampling_seed": 11}}),
])
def test_accepted_and_same_tokens(http: httpx.Client, case: str, body: dict[str, Any]) -> None:
    assert _tokens(http, body) == _tokens(http, MINIMAL), case


def test_top_level_max_new_tokens_is_a_default(http: httpx.Client) -> None:
    """sampling_params.max_new_tokens wins over the top-level one; the top-level one applies to each of a batch."""
    body = {"input_ids": PROMPT, "max_new_tokens": 2, "sampling_params": GREEDY}
    assert len(_tokens(http, body)) == 4
    r = http.post("/generate", json={"input_ids": [PROMPT, PROMPT], "max_new_tokens": 3,
                                     "sampling_params": [{"temperature": 0}, {"temperature": 0}]})
    assert r.status_code == 200, r.text
    assert [len(o["output_ids"]) for o in r.json()] == [3, 3]


def test_sampling_seed_reproduces_seed(http: httpx.Client) -> None:
    sampled = {"max_new_tokens": 6, "temperature": 1.0}
    a = _tokens(http, {"input_ids": PROMPT, "sampling_params": {**sampled, "seed": 5}})
    b = _tokens(http, {"input_ids": PROMPT, "sampling_params": {**sampled, "sampling_seed": 5}})
    assert a == b


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("lora_path", {**MINIMAL, "lora_path": "adapters/a"}, "lora_path", "LoRA adapters are not served"),
    ("lora_path in a list", {**MINIMAL, "lora_path": [None, "a"]}, "lora_path", "LoRA adapters are not served"),
    ("custom_logit_processor", {**MINIMAL, "custom_logit_processor": "{}"}, "custom_logit_processor", "not run"),
    ("return_hidden_states", {**MINIMAL, "return_hidden_states": True}, "return_hidden_states", ""),
    ("unknown top-level", {**MINIMAL, "not_an_sglang_field": 1}, "not_an_sglang_field", ""),
    ("unknown sampling", {"input_ids": PROMPT, "sampling_params": {**GREEDY, "not_a_param": 1}},
     "sampling_params.not_a_param", ""),
    ("seed and sampling_seed differ", {"input_ids": PROMPT, "sampling_params": {"seed": 1, "sampling_seed": 2}},
     "sampling_params.sampling_seed", "differs from seed"),
]


@pytest.mark.parametrize(("case", "body", "field", "why"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_with_the_field_named(http: httpx.Client, case: str, body: dict[str, Any], field: str,
                                      why: str) -> None:
    r = http.post("/generate", json=body)
    assert r.status_code == 400, (case, r.text)
    err = r.json()["error"]
    assert err["param"] == field, err
    assert field.split(".")[-1] in err["message"] and why in err["message"], err


# OpenAI bodies: the fields of openai-python's CompletionCreateParams / ChatCompletionCreateParams, as SGLang's
# python/sglang/srt/entrypoints/openai/protocol.py carries them.
COMPLETION = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_openai_fields_accepted_same_output(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    full = {**body, "user": "u-1", "seed": 3, "n": 1, "response_format": {"type": "text"}}
    a, b = http.post(path, json=body), http.post(path, json=full)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    assert a.json()["choices"] == b.json()["choices"]
    assert a.json()["usage"] == b.json()["usage"]


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_stream_include_usage(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    """OpenAI's include_usage: one last chunk with `choices: []` and the usage of the non-streamed response; every
    other chunk then carries `"usage": null` (openai-python's ChatCompletionChunk / Completion: `usage: Optional`,
    "null on every chunk but the last" when include_usage is set); without it no chunk has the key."""
    usage = http.post(path, json=body).json()["usage"]
    plain = stream_json(http, path, body)
    assert all("usage" not in e for e in plain)
    events = stream_json(http, path, {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"] == usage
    assert len(events) > 2 and all("usage" in e and e["usage"] is None for e in events[:-1])


def test_chat_text_parts_are_the_string(http: httpx.Client) -> None:
    parts = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert http.post("/v1/chat/completions", json=parts).json()["choices"] == \
        http.post("/v1/chat/completions", json=CHAT).json()["choices"]


OPENAI_REFUSED: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("n over OpenAI's 128", "/v1/chat/completions", {**CHAT, "n": 129}, "n", "128"),
    ("json response_format", "/v1/completions", {**COMPLETION, "response_format": {"type": "json_object"}},
     "response_format", "only \"text\""),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools", "not served"),
    ("tool_choice", "/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice", "not served"),
    ("image part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1]", "only text"),
    ("unknown stream option", "/v1/completions", {**COMPLETION, "stream_options": {"bogus": True}},
     "stream_options.bogus", ""),
    ("unknown openai field", "/v1/chat/completions", {**CHAT, "not_an_openai_field": 1}, "not_an_openai_field", ""),
]


@pytest.mark.parametrize(("case", "path", "body", "field", "why"), OPENAI_REFUSED, ids=[c[0] for c in OPENAI_REFUSED])
def test_openai_refused_with_the_field_named(http: httpx.Client, case: str, path: str, body: dict[str, Any],
                                             field: str, why: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, (case, r.text)
    err = r.json()["error"]
    assert err["param"] == field, err
    assert field.split(".")[-1].split("[")[0] in err["message"] and why in err["message"], err
