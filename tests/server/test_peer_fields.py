"""Every further field of SGLang's request bodies: honoured (logit_bias, max_completion_tokens, data_parallel_rank,
chat_template_kwargs, reasoning_effort, chat input_ids), accepted and ignored where it cannot change the output
here, or a 400 that names the field and says why.

The field lists, read (not copied) from sgl-project/sglang:
- python/sglang/srt/sampling/sampling_params.py at 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03 (SamplingParams:
  json_schema, regex, ebnf, structural_tag, stop_regex, custom_params, stream_interval, logit_bias);
- python/sglang/srt/managers/io_struct.py at 001067fffe33427bee0ed2f007fb7551a1d76b44 (GenerateReqInput: the media,
  embedding, session, LoRA, PD-bootstrap, return_* and bookkeeping fields; normalize_batch_and_arguments copies
  data_parallel_rank into routed_dp_rank when that is unset);
- python/sglang/srt/entrypoints/openai/protocol.py at 004c82e07d876f6e4a0ad6e15325706b0f478f1a (CompletionRequest:
  best_of, suffix, logit_bias; ChatCompletionRequest: max_completion_tokens, which to_sampling_params prefers
  over max_tokens, chat_template_kwargs, reasoning_effort -> thinking / enable_thinking set where unset,
  input_ids, parallel_tool_calls, separate_reasoning; both: SGLang's extras). OpenAI fields SGLang leaves to
  pydantic's default (ignored): metadata, store, service_tier, prediction, modalities, audio.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_peer_fields.py
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from r3trace.server.chat import render_chat
from r3trace.server.openai_requests import ChatCompletionRequest, ChatMessage

PROMPT = [5, 6, 7, 8]
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
MINIMAL = {"input_ids": PROMPT, "sampling_params": GREEDY}
COMPLETION = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _ok(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _top3(http: httpx.Client, prompt: list[int]) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 1}, "return_logprob": True,
            "top_logprobs_num": 3}
    return [t[1] for t in _ok(http, "/generate", body)["meta_info"]["output_top_logprobs"][0]]


def test_logit_bias_on_every_endpoint(http: httpx.Client) -> None:
    """-100 on the greedy token: the output's first token is the unbiased second-best; +100 on the third-best: every
    token is it. /generate's sampling_params.logit_bias, and the OpenAI bodies' top-level logit_bias."""
    best, second, third = _top3(http, PROMPT)
    gen = _ok(http, "/generate", {"input_ids": PROMPT, "sampling_params": {**GREEDY, "logit_bias": {str(best): -100}}})
    assert gen["output_ids"][0] == second
    gen = _ok(http, "/generate", {"input_ids": PROMPT, "sampling_params": {**GREEDY, "logit_bias": {str(third): 100}}})
    assert gen["output_ids"] == [third] * 4
    banned = _ok(http, "/v1/completions", {**COMPLETION, "logit_bias": {str(best): -100}, "logprobs": 0})
    forced = _ok(http, "/v1/completions", {**COMPLETION, "logit_bias": {str(third): 100}, "echo": False})
    plain = _ok(http, "/v1/completions", COMPLETION)
    assert banned["choices"][0]["text"] != plain["choices"][0]["text"]
    assert forced["choices"][0]["text"] == _ok(http, "/generate", {
        "input_ids": PROMPT, "sampling_params": {**GREEDY, "logit_bias": {str(third): 100}}})["text"]
    chat = _ok(http, "/v1/chat/completions", {**CHAT, "logit_bias": {str(third): 100}})
    assert chat["usage"]["completion_tokens"] == 4
    assert chat["choices"][0]["message"]["content"] == gen["text"]


def test_max_completion_tokens_wins_over_max_tokens(http: httpx.Client) -> None:
    body = {**CHAT, "max_tokens": 5, "max_completion_tokens": 2}
    assert _ok(http, "/v1/chat/completions", body)["usage"]["completion_tokens"] == 2
    assert _ok(http, "/v1/chat/completions", {**CHAT, "max_tokens": 3})["usage"]["completion_tokens"] == 3


GENERATE_IGNORED = {
    "session_id": "s", "log_metrics": False, "no_logs": True, "custom_labels": {"a": "b"}, "conversation_id": "c",
    "routing_key": "k", "external_trace_header": {"traceparent": "x"}, "received_time": 1.5, "http_worker_ipc": "ipc",
    "background": False, "cache_salt": "salt", "kv_router_hint": {"block_hashes": []}, "bootstrap_host": "h",
    "bootstrap_port": 1, "bootstrap_room": 2, "bootstrap_pair_key": "p", "decode_tp_size": 1,
    "disagg_prefill_dp_rank": 0, "max_dynamic_patch": 4, "min_dynamic_patch": 1, "image_max_dynamic_patch": 2,
    "video_max_dynamic_patch": 2, "use_audio_in_video": False, "video_config": {}, "images_config": {},
    "modalities": [None], "need_wait_for_mm_inputs": False, "encoder_urls": [],
    # refused fields at their "not asked" values
    "image_data": None, "input_embeds": None, "return_hidden_states": False, "lora_path": [None],
    "token_ids_logprob": [], "session_params": None, "return_prompt_token_ids": False, "data_parallel_rank": 0,
}
SAMPLING_IGNORED = {"custom_params": {"x": 1}, "stream_interval": 3, "json_schema": None, "regex": None}
OPENAI_IGNORED = {
    "rid": "r", "session_id": "s", "extra_key": "k", "cache_salt": "c", "ngram_corpus_id": "n", "priority": 1,
    "custom_labels": {"a": "b"}, "custom_params": {}, "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2,
    "disagg_prefill_dp_rank": 0, "images_config": {}, "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
    "prediction": {"type": "content", "content": "x"}, "modalities": ["text"], "routed_dp_rank": 0,
    "regex": None, "lora_path": None, "return_hidden_states": False,
}
CHAT_IGNORED = {"parallel_tool_calls": True, "separate_reasoning": True, "stream_reasoning": False, "task": "domain",
                "max_dynamic_patch": 2, "min_dynamic_patch": 1, "use_audio_in_video": False}


@pytest.mark.parametrize(("path", "body", "extra"), [
    ("/generate", MINIMAL, {**GENERATE_IGNORED, "sampling_params": {**GREEDY, **SAMPLING_IGNORED}}),
    ("/v1/completions", COMPLETION, {**OPENAI_IGNORED, "best_of": 1}),
    ("/v1/chat/completions", CHAT, {**OPENAI_IGNORED, **CHAT_IGNORED}),
], ids=["generate", "completions", "chat"])
def test_ignored_fields_give_the_same_output(http: httpx.Client, path: str, body: dict[str, Any],
                                             extra: dict[str, Any]) -> None:
    plain, full = _ok(http, path, body), _ok(http, path, {**body, **extra})
    key = "output_ids" if path == "/generate" else "choices"
    assert full[key] == plain[key]


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("/generate", {**MINIMAL, "sampling_params": {**GREEDY, "json_schema": "{}"}}, "sampling_params.json_schema",
     "constrained decoding is not served"),
    ("/generate", {"input_ids": [PROMPT], "sampling_params": [{**GREEDY, "regex": "a+"}]},
     "sampling_params[0].regex", "constrained decoding is not served"),
    ("/generate", {**MINIMAL, "sampling_params": {**GREEDY, "ebnf": "root ::= a"}}, "sampling_params.ebnf",
     "constrained decoding"),
    ("/generate", {**MINIMAL, "sampling_params": {**GREEDY, "structural_tag": "{}"}}, "sampling_params.structural_tag",
     "constrained decoding"),
    ("/generate", {**MINIMAL, "image_data": "http://x/a.png"}, "image_data", "text only"),
    ("/generate", {**MINIMAL, "audio_data": ["a.wav"]}, "audio_data", "text only"),
    ("/generate", {**MINIMAL, "video_data": "v.mp4"}, "video_data", "text only"),
    ("/generate", {"input_embeds": [[0.1, 0.2]]}, "input_embeds", "input embeddings are not served"),
    ("/generate", {**MINIMAL, "lora_id": "a"}, "lora_id", "LoRA adapters are not served"),
    ("/generate", {**MINIMAL, "return_hidden_states": "last"}, "return_hidden_states", "does not return it"),
    ("/generate", {**MINIMAL, "return_entropy": True}, "return_entropy", "does not return it"),
    ("/generate", {**MINIMAL, "session_params": {"id": "s"}}, "session_params", "sessions"),
    ("/generate", {**MINIMAL, "max_thinking_tokens": 8}, "max_thinking_tokens", "reasoning"),
    ("/generate", {**MINIMAL, "data_parallel_rank": 3}, "routed_dp_rank", ""),  # mapped, then checked by the engine
    ("/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix", "insertion"),
    ("/v1/completions", {**COMPLETION, "best_of": 2}, "best_of", "not served"),
    ("/v1/completions", {**COMPLETION, "json_schema": "{}"}, "json_schema", "constrained decoding is not served"),
    ("/v1/completions", {**COMPLETION, "lora_path": "adapter"}, "lora_path", "LoRA"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"3": 101}}, "sampling_params.logit_bias", "[-100, 100]"),
    ("/v1/chat/completions", {**CHAT, "ebnf": "root ::= a"}, "ebnf", "constrained decoding"),
    ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio output"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities", "only \"text\""),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions", "tool calls"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "cannot set both"),
    ("/v1/chat/completions", {**CHAT, "data_parallel_rank": 2}, "routed_dp_rank", ""),
]


@pytest.mark.parametrize(("path", "body", "field", "why"), REFUSED, ids=[f"{c[0]} {c[2]}" for c in REFUSED])
def test_refused_names_the_field_and_why(http: httpx.Client, path: str, body: dict[str, Any], field: str,
                                         why: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and why in err["message"], err
    assert "\n" not in err["message"]


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template() -> None:
    """chat_template_kwargs are template variables; reasoning_effort sets thinking / enable_thinking where unset
    (SGLang's normalize_reasoning_inputs), an explicit kwarg winning."""
    tpl = "{{ thinking }}|{{ enable_thinking }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}]

    def render(**fields: Any) -> str:
        req = ChatCompletionRequest(messages=[ChatMessage(**m) for m in msgs], **fields)
        return render_chat(req.messages, tpl, req.template_kwargs())

    assert render(chat_template_kwargs={"thinking": True}) == "True||hi"
    assert render(reasoning_effort="high") == "True|True|hi"
    assert render(reasoning_effort="none") == "False|False|hi"
    assert render(reasoning_effort="low", chat_template_kwargs={"thinking": False}) == "False|True|hi"
    assert render(chat_template_kwargs={"messages": []}) == "||hi"  # the messages are never overridden


def test_chat_input_ids_skip_the_template(http: httpx.Client) -> None:
    """SGLang's chat input_ids: the prompt's token ids as given, so the same tokens as /v1/completions on them."""
    chat = _ok(http, "/v1/chat/completions", {**CHAT, "input_ids": PROMPT})
    assert chat["choices"][0]["message"]["content"] == _ok(http, "/v1/completions", COMPLETION)["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == len(PROMPT)
