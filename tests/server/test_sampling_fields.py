"""SGLang's sampling fields over HTTP: /generate's sampling_params and the OpenAI bodies' names for them reach the
engine and give its tokens and text; a value out of range is a 400 naming the field and the limit.

The names, read (not copied) from sgl-project/sglang: python/sglang/srt/sampling/sampling_params.py at
00c17cafcb9e289d5ca97c50e44ada54e4fd5b03 (min_p, frequency/presence/repetition_penalty, min_new_tokens,
skip_special_tokens, spaces_between_special_tokens, no_stop_trim) and python/sglang/srt/entrypoints/openai/protocol.py
at 004c82e07d876f6e4a0ad6e15325706b0f478f1a (CompletionRequest / ChatCompletionRequest: frequency_penalty and
presence_penalty as OpenAI's, and the extras min_p, min_tokens -> min_new_tokens, repetition_penalty,
no_stop_trim, skip_special_tokens).

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_sampling_fields.py
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from r3trace.engine import Engine
from r3trace.server.chat import render_chat
from r3trace.server.openai_requests import ChatMessage

PROMPT = [11, 42, 97, 5, 230, 64]
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PENALISED: list[dict[str, Any]] = [
    {**GREEDY, "repetition_penalty": 1.8},
    {**GREEDY, "frequency_penalty": 1.2, "presence_penalty": 0.6},
    {"temperature": 0.9, "max_new_tokens": 10, "ignore_eos": True, "seed": 4, "min_p": 0.2,
     "presence_penalty": -0.5},
]


def _generate(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("params", PENALISED)
def test_generate_gives_the_engines_tokens(http: httpx.Client, engine: Engine, params: dict[str, Any]) -> None:
    out = _generate(http, {"input_ids": PROMPT, "sampling_params": params})
    direct = engine.generate(input_ids=PROMPT, sampling_params=params)
    assert out["output_ids"] == direct["output_ids"] and out["text"] == direct["text"]
    plain = engine.generate(input_ids=PROMPT, sampling_params={k: v for k, v in params.items()
                                                               if "penalty" not in k and k != "min_p"})
    assert out["output_ids"] != plain["output_ids"]


def _completion(http: httpx.Client, path: str, body: dict[str, Any]) -> str:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


OPENAI_EXTRAS = {"frequency_penalty": 1.2, "presence_penalty": 0.6, "repetition_penalty": 1.5, "min_p": 0.1,
                 "no_stop_trim": True, "skip_special_tokens": False}


def test_openai_fields_are_the_sampling_params_of_the_same_names(http: httpx.Client) -> None:
    """min_tokens is SGLang's OpenAI name for min_new_tokens: a stop token id that is the greedy first token is
    held back for one token."""
    sp = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    want = _generate(http, {"input_ids": PROMPT, "sampling_params": {**sp, **OPENAI_EXTRAS}})["text"]
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **OPENAI_EXTRAS}
    assert _completion(http, "/v1/completions", body) == want
    assert want != _generate(http, {"input_ids": PROMPT, "sampling_params": sp})["text"]

    first = _generate(http, {"input_ids": PROMPT, "sampling_params": sp})["output_ids"][0]
    held = {**sp, "stop_token_ids": [first], "min_new_tokens": 1, "ignore_eos": False}
    want = _generate(http, {"input_ids": PROMPT, "sampling_params": held})
    assert want["output_ids"][0] != first
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": False, "stop_token_ids": [first],
            "min_tokens": 1}
    assert _completion(http, "/v1/completions", body) == want["text"]

    messages = [{"role": "user", "content": "hi"}]
    rendered = render_chat([ChatMessage(**m) for m in messages], None)
    want_chat = _generate(http, {"text": rendered, "sampling_params": {**sp, **OPENAI_EXTRAS}})["text"]
    chat = {"messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **OPENAI_EXTRAS}
    assert _completion(http, "/v1/chat/completions", chat) == want_chat


def test_no_stop_trim_over_http(http: httpx.Client) -> None:
    sp = {"temperature": 0, "max_new_tokens": 30}
    full = _generate(http, {"input_ids": PROMPT, "sampling_params": sp})["output_ids"]
    j = next(i for i, t in enumerate(full) if 32 <= t < 127)  # byte-level ids: the first printable character
    stop = chr(full[j])
    trimmed = _generate(http, {"input_ids": PROMPT, "sampling_params": {**sp, "stop": stop}})["text"]
    kept = _generate(http, {"input_ids": PROMPT, "sampling_params": {**sp, "stop": stop, "no_stop_trim": True}})
    assert kept["text"] == trimmed + stop
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stop": stop, "no_stop_trim": True}
    assert _completion(http, "/v1/completions", body) == kept["text"]



def test_stop_regex_over_http(http: httpx.Client) -> None:
    """/generate's sampling_params.stop_regex and the OpenAI bodies' top-level stop_regex (SGLang's extra) stop at
    the same token as the engine's rule: the first greedy prefix the regex matches; finish_reason "stop"."""
    sp = {"temperature": 0, "max_new_tokens": 30}
    full = _generate(http, {"input_ids": PROMPT, "sampling_params": sp})["output_ids"]
    j = next(i for i, t in enumerate(full) if 48 <= t < 58 or 65 <= t < 91 or 97 <= t < 123)  # a letter or digit
    pattern = f"[{chr(full[j])}]"  # metacharacters: not trimmed (its own text never occurs)
    out = _generate(http, {"input_ids": PROMPT, "sampling_params": {**sp, "stop_regex": pattern}})
    assert out["output_ids"] == full[: j + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stop_regex": [pattern]}
    assert _completion(http, "/v1/completions", body) == out["text"]
    r = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {**sp, "stop_regex": "(a"}})
    assert r.status_code == 400 and "sampling_params.stop_regex" in r.text, r.text


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"repetition_penalty": 3}},
     "sampling_params.repetition_penalty", "must be in (0, 2]"),
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"min_p": -0.1}}, "sampling_params.min_p",
     "must be in [0, 1]"),
    ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}},
     "sampling_params.min_new_tokens", "max_new_tokens=4"),
    ("/v1/completions", {"prompt": PROMPT, "frequency_penalty": 2.5}, "sampling_params.frequency_penalty",
     "must be in [-2, 2]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -3},
     "sampling_params.presence_penalty", "must be in [-2, 2]"),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": 17}, "sampling_params.min_new_tokens",
     "max_new_tokens=16"),
]


@pytest.mark.parametrize(("path", "body", "field", "limit"), REFUSED, ids=[c[2] for c in REFUSED])
def test_out_of_range_is_a_400_naming_field_and_limit(http: httpx.Client, path: str, body: dict[str, Any],
                                                      field: str, limit: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and limit in err["message"], err


def test_openai_bodies_pass_each_field_on() -> None:
    """Each OpenAI-body field lands in the engine's sampling_params under SGLang's /generate name."""
    from r3trace.server.openai_api import engine_kwargs
    from r3trace.server.openai_requests import ChatCompletionRequest, CompletionRequest

    for req in (CompletionRequest(prompt=PROMPT, min_tokens=3, **OPENAI_EXTRAS),
                ChatCompletionRequest(messages=[ChatMessage(role="user", content="hi")], min_tokens=3,
                                      **OPENAI_EXTRAS)):
        sp = engine_kwargs(req, PROMPT, 10)["sampling_params"]
        assert {k: sp[k] for k in OPENAI_EXTRAS} == OPENAI_EXTRAS and sp["min_new_tokens"] == 3


def test_generate_body_passes_every_field_on() -> None:
    """/generate's sampling_params reach the engine whole (no field accepted and dropped)."""
    from r3trace.server.protocol import SamplingParamsBody

    sp = {"max_new_tokens": 9, "min_new_tokens": 2, "temperature": 0.5, "top_k": 7, "top_p": 0.9, "min_p": 0.1,
          "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.3, "seed": 3,
          "stop": ["x"], "stop_token_ids": [4], "ignore_eos": True, "sampling_seed": 3, "skip_special_tokens": False,
          "spaces_between_special_tokens": False, "no_stop_trim": True, "logit_bias": {"3": 1.5}}
    assert SamplingParamsBody(**sp).to_engine() == sp
