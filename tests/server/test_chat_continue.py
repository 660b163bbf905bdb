"""continue_final_message and add_generation_prompt on /v1/chat/completions.

The contract, read (not copied) from:
- sgl-project/sglang python/sglang/srt/entrypoints/openai/serving_chat.py at
  002897c23becbd522d88b8115a763a21765f978a: _handle_last_assistant_message takes a last assistant message's
  string content out of the messages when continue_final_message is set; _apply_jinja_template renders the rest
  with add_generation_prompt=True and appends that content to the rendered prompt, so the model continues it; with
  another last message the flag changes nothing;
- vllm-project/vllm vllm/entrypoints/openai/chat_completion/protocol.py at 002032ee2b18e1f7bd924ec47b62504ba3866063:
  `add_generation_prompt: bool = True`, and check_generation_prompt refuses a body that sets both
  continue_final_message and add_generation_prompt true ("Cannot set both ... to True"); it reads the raw body, so a
  body without add_generation_prompt passes.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_chat_continue.py
"""

from __future__ import annotations

from typing import Any

import httpx

from r3trace.server.chat import FALLBACK_TEMPLATE, render_chat
from r3trace.server.openai_requests import ChatMessage

SP = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_prompt_token_ids": True}
USER = {"role": "user", "content": "Tell a story."}
PREFILL = {"role": "assistant", "content": "Once upon a"}


def _chat(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={**SP, **body})
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def _generate(http: httpx.Client, text: str) -> dict[str, Any]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
            "return_prompt_token_ids": True}
    return dict(http.post("/generate", json=body).json())


def test_continue_final_message_continues_the_assistant_text(http: httpx.Client) -> None:
    want_text = render_chat([ChatMessage(**USER)], None) + PREFILL["content"]
    assert want_text == "user: Tell a story.\nassistant:Once upon a"  # the fallback template, then the prefix
    want = _generate(http, want_text)
    got = _chat(http, {"messages": [USER, PREFILL], "continue_final_message": True})
    assert got["prompt_token_ids"] == want["prompt_token_ids"]
    assert got["message"]["content"] == want["text"]
    # without the flag the assistant message is closed and a new turn opens after it
    closed = _chat(http, {"messages": [USER, PREFILL]})
    assert closed["prompt_token_ids"] == _generate(http, render_chat([ChatMessage(**USER), ChatMessage(**PREFILL)],
                                                                     None))["prompt_token_ids"]
    assert closed["prompt_token_ids"] != got["prompt_token_ids"]


def test_continue_final_message_after_a_user_message_changes_nothing(http: httpx.Client) -> None:
    plain = _chat(http, {"messages": [USER]})
    flagged = _chat(http, {"messages": [USER], "continue_final_message": True})
    assert flagged["prompt_token_ids"] == plain["prompt_token_ids"]


def test_add_generation_prompt_false_leaves_the_turn_closed(http: httpx.Client) -> None:
    assert FALLBACK_TEMPLATE.endswith("{% if add_generation_prompt %}assistant:{% endif %}")
    got = _chat(http, {"messages": [USER], "add_generation_prompt": False})
    want = _generate(http, render_chat([ChatMessage(**USER)], None, add_generation_prompt=False))
    assert want["prompt_token_ids"] == _generate(http, "user: Tell a story.\n")["prompt_token_ids"]
    assert got["prompt_token_ids"] == want["prompt_token_ids"]


def test_both_flags_true_is_vllms_400(http: httpx.Client) -> None:
    body = {**SP, "messages": [USER, PREFILL], "continue_final_message": True, "add_generation_prompt": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"]
    # input_ids skip the template, but the body is still checked (vLLM validates the body first)
    r = http.post("/v1/chat/completions", json={**body, "input_ids": [5, 6, 7]})
    assert r.status_code == 400
