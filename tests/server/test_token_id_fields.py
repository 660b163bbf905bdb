"""SGLang's token-id return fields, served: /generate's return_prompt_token_ids, /v1/completions' return_token_ids
and /v1/chat/completions' return_prompt_token_ids / return_token_ids.

The contract, read (not copied) from sgl-project/sglang at 004c82e07d876f6e4a0ad6e15325706b0f478f1a:
- python/sglang/srt/entrypoints/openai/protocol.py: CompletionRequest.return_token_ids; ChatCompletionRequest
  .return_prompt_token_ids and .return_token_ids; the response choices' `token_ids` and `prompt_token_ids` (left
  out of the JSON when null);
- python/sglang/srt/entrypoints/openai/serving_completions.py: return_token_ids sets GenerateReqInput
  .return_prompt_token_ids; a choice's token_ids are the result's `output_ids`, its prompt_token_ids the result's
  top-level `prompt_token_ids`; a stream chunk carries the output ids it adds, and the prompt ids on the choice's
  first chunk only.
Chat streams: SGLang refuses return_prompt_token_ids there; r3trace serves both fields as the completions stream
does (docs/compatibility.md).

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_token_id_fields.py
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.server.sse import stream_json

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
COMPLETION = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True}


def _ok(http: httpx.Client, path: str, body: dict[str, Any]) -> Any:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy_ids(http: httpx.Client, prompt: list[int]) -> list[int]:
    return list(_ok(http, "/generate", {"input_ids": prompt, "sampling_params": GREEDY})["output_ids"])


def test_generate_return_prompt_token_ids(http: httpx.Client) -> None:
    """Top-level prompt_token_ids: the given ids; for a text prompt the engine's tokenization, which as input_ids
    gives the same output; absent when not asked; a stream has them on its first chunk only."""
    out = _ok(http, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "return_prompt_token_ids": True})
    assert out["prompt_token_ids"] == PROMPT
    assert "prompt_token_ids" not in _ok(http, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    text = _ok(http, "/generate", {"text": "the cat", "sampling_params": GREEDY, "return_prompt_token_ids": True})
    ids = text["prompt_token_ids"]
    assert len(ids) == text["meta_info"]["prompt_tokens"]
    assert _greedy_ids(http, ids) == text["output_ids"]
    batch = _ok(http, "/generate", {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": GREEDY,
                                    "return_prompt_token_ids": True})
    assert [r["prompt_token_ids"] for r in batch] == [PROMPT, PROMPT[:3]]
    for incremental in (False, True):
        chunks = stream_json(http, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY,
                                             "return_prompt_token_ids": True,
                                             "incremental_streaming_output": incremental})
        assert chunks[0]["prompt_token_ids"] == PROMPT
        assert all("prompt_token_ids" not in c for c in chunks[1:]), incremental


def test_completions_return_token_ids(http: httpx.Client) -> None:
    """token_ids: the output ids /generate returns for the same greedy request; prompt_token_ids: the prompt's.
    Streamed, the chunks' token_ids join to the same ids and prompt_token_ids come once, first."""
    want = _greedy_ids(http, PROMPT)
    body = _ok(http, "/v1/completions", {**COMPLETION, "return_token_ids": True})
    [choice] = body["choices"]
    assert choice["token_ids"] == want and choice["prompt_token_ids"] == PROMPT
    plain = _ok(http, "/v1/completions", COMPLETION)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    two = _ok(http, "/v1/completions", {**COMPLETION, "prompt": [PROMPT, PROMPT[:3]], "return_token_ids": True})
    assert [c["prompt_token_ids"] for c in two["choices"]] == [PROMPT, PROMPT[:3]]
    assert two["choices"][1]["token_ids"] == _greedy_ids(http, PROMPT[:3])
    chunks = stream_json(http, "/v1/completions", {**COMPLETION, "return_token_ids": True})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert sum((c["token_ids"] for c in choices), []) == want
    assert choices[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in c for c in choices[1:])


def test_chat_return_prompt_and_token_ids(http: httpx.Client) -> None:
    """prompt_token_ids: the templated prompt's ids (sent back as input_ids they give the same reply), or the
    chat's own input_ids; token_ids: the reply's ids. Each only when asked; streamed as on /v1/completions."""
    body = _ok(http, "/v1/chat/completions", {**CHAT, "return_prompt_token_ids": True, "return_token_ids": True})
    [choice] = body["choices"]
    ids = choice["prompt_token_ids"]
    assert len(ids) == body["usage"]["prompt_tokens"]
    assert choice["token_ids"] == _greedy_ids(http, ids)
    only_prompt = _ok(http, "/v1/chat/completions", {**CHAT, "return_prompt_token_ids": True})["choices"][0]
    assert only_prompt["prompt_token_ids"] == ids and "token_ids" not in only_prompt
    only_out = _ok(http, "/v1/chat/completions", {**CHAT, "return_token_ids": True})["choices"][0]
    assert only_out["token_ids"] == choice["token_ids"] and "prompt_token_ids" not in only_out
    given = _ok(http, "/v1/chat/completions", {**CHAT, "input_ids": PROMPT, "return_prompt_token_ids": True})
    assert given["choices"][0]["prompt_token_ids"] == PROMPT
    chunks = stream_json(http, "/v1/chat/completions", {**CHAT, "return_prompt_token_ids": True,
                                                    "return_token_ids": True})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert sum((c["token_ids"] for c in choices), []) == choice["token_ids"]
    assert choices[0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c for c in choices[1:])


def test_token_id_flags_checked(http: httpx.Client) -> None:
    """A non-boolean flag is a 400 naming the field (the bodies are strict)."""
    for path, body, name in (("/generate", {"input_ids": PROMPT, "return_prompt_token_ids": "yes"},
                              "return_prompt_token_ids"),
                             ("/v1/completions", {**COMPLETION, "return_token_ids": 1}, "return_token_ids")):
        r = http.post(path, json=body)
        assert r.status_code == 400 and name in r.text, r.text


def test_generate_token_ids_logprob(http: httpx.Client) -> None:
    """/generate's token_ids_logprob (SGLang's GenerateReqInput field, io_struct.py at
    001067fffe33427bee0ed2f007fb7551a1d76b44): meta_info's output_token_ids_logprobs equal the full top list's
    entries at those ids (the same request's: a prefix-cache hit may move the last float bit); return_text_in_logprobs
    names them; the default stream's last chunk holds all of them."""
    ids = [9, 3, 9]
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "token_ids_logprob": ids}

    def want(meta: dict[str, Any]) -> list[Any]:  # each listed id's entry in the full top list of its position
        return [[[{t[1]: t[0] for t in top}[i], i, None] for i in ids] for top in meta["output_top_logprobs"]]

    full = _ok(http, "/generate", {**body, "top_logprobs_num": 320})["meta_info"]
    assert full["output_token_ids_logprobs"] == want(full) and len(full["output_top_logprobs"]) == 5
    named = _ok(http, "/generate", {**body, "return_text_in_logprobs": True})["meta_info"]
    assert all(isinstance(e[2], str) for pos in named["output_token_ids_logprobs"] for e in pos)
    last = stream_json(http, "/generate", {**body, "top_logprobs_num": 320})[-1]["meta_info"]
    assert last["output_token_ids_logprobs"] == want(last) and len(last["output_top_logprobs"]) == 5
