"""OpenAI logprobs and echo on the bundled sample model: the engine's own logprobs, each the log_softmax of
transformers' logits at the chosen token, in OpenAI's shapes.

Contracts, as read from their sources (nothing copied):
- openai-python src/openai/types/completion_create_params.py @ 08b8179a6b3e46ca8eb117f819cc6563ae74e27d:
  completions `logprobs` lists the most likely tokens "as well the chosen tokens ... up to logprobs+1 elements";
  completion_choice.py (same commit): Logprobs = tokens, token_logprobs, top_logprobs, text_offset.
- openai-python src/openai/types/chat/chat_completion_token_logprob.py @ 3e9e851643ca8abaf286b53128dc3da7d7ac4fc3:
  chat content entries {token, bytes, logprob, top_logprobs: [{token, bytes, logprob}]}, bytes the token's UTF-8
  bytes "useful where characters are represented by multiple tokens".
- sgl-project/sglang python/sglang/srt/entrypoints/openai/serving_completions.py @
  004c82e07d876f6e4a0ad6e15325706b0f478f1a: echo prepends the prompt (a token-id prompt decoded) to the text and,
  with logprobs, asks for logprob_start_len=0 so the prompt tokens come first; entrypoints/openai/utils.py @
  0101654f9cc8d059f1c0914628f00a8cee65f9e0 (to_openai_style_logprobs): prompt token 0 has logprob None and
  top_logprobs None; SGLang sends text_offset -1, r3trace the offset OpenAI defines.
- serving_chat.py @ 002897c23becbd522d88b8115a763a21765f978a: chat logprobs from logprobs + top_logprobs
  (top_logprobs without logprobs ignored).
- io_struct.py @ 001067fffe33427bee0ed2f007fb7551a1d76b44: return_text_in_logprobs fills each entry's text.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_openai_logprobs.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch

from bench.tiny_models import load_hf
from r3trace.engine import Engine
from tests.server.conftest import SAMPLE
from tests.server.sse import stream_json

PROMPT = "def fib(n):"
TOP = 3
# fp32 on both sides; transformers' normal-form MLA in one pass against the engine's absorbed MLA over its paged
# cache: measured worst |diff| 5.2e-6 over these prompts (torch 2.13 CPU). A logprob read at the wrong position,
# of another token or without the log_softmax is off by > 1e-1.
ATOL = 1e-5
SEEDED = {"temperature": 1.0, "seed": 5, "ignore_eos": True}  # sampled tokens: not always the argmax


@pytest.fixture(scope="module")
def oracle() -> Callable[[list[int]], torch.Tensor]:
    """ids -> transformers' log_softmax over the sequence [T, V]: row p scores token p + 1."""
    hf = load_hf(SAMPLE)

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return run


def _engine_ids(engine: Engine, prompt: str, n_new: int) -> list[int]:
    out = engine.generate(prompt=prompt, sampling_params={**SEEDED, "max_new_tokens": n_new})
    assert isinstance(out, dict)
    return list(out["output_ids"])


def test_completion_logprobs_are_the_engines(sample_http: httpx.Client, sample_engine: Engine) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": TOP, **SEEDED}
    choice = sample_http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    want = sample_engine.generate(prompt=PROMPT, sampling_params={**SEEDED, "max_new_tokens": 6},
                                  return_logprob=True, top_logprobs_num=TOP)
    assert isinstance(want, dict)
    tok = sample_engine.tokenizer
    out = want["meta_info"]["output_token_logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for _, t, _ in out]
    assert lp["token_logprobs"] == pytest.approx([v for v, _, _ in out], abs=ATOL)
    for got, top, (v, t, _) in zip(lp["top_logprobs"], want["meta_info"]["output_top_logprobs"], out, strict=True):
        expected = {tok.decode([i]): w for w, i, _ in top}
        expected.setdefault(tok.decode([t]), v)  # the chosen token, listed where the top ones lack it
        assert got == pytest.approx(expected, abs=ATOL)
        assert TOP <= len(got) <= TOP + 1
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:k]) for k in range(len(lp["tokens"]))]


def test_chosen_logprob_is_log_softmax_with_echo(sample_http: httpx.Client, sample_engine: Engine,
                                                 oracle: Callable[[list[int]], torch.Tensor]) -> None:
    """echo: the prompt's tokens first (the first unpredicted: null), then the output's; every logprob is the
    log_softmax of transformers' logits at its token, every top list the row's best TOP."""
    n_new = 8
    body = {"prompt": PROMPT, "max_tokens": n_new, "logprobs": TOP, "echo": True, **SEEDED}
    choice = sample_http.post("/v1/completions", json=body).json()["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    tok = sample_engine.tokenizer
    prompt_ids = tok.encode(PROMPT)
    ids = prompt_ids + _engine_ids(sample_engine, PROMPT, n_new)  # same seed: the same tokens
    ref = oracle(ids)  # [T, V]
    assert text.startswith(PROMPT) and len(lp["tokens"]) == len(ids)
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=ATOL)
    for p in range(1, len(ids)):
        best = ref[p - 1].topk(TOP)
        row = {tok.decode([int(i)]): v.item() for v, i in zip(best.values, best.indices, strict=True)}
        row.setdefault(tok.decode([ids[p]]), ref[p - 1, ids[p]].item())
        assert lp["top_logprobs"][p] == pytest.approx(row, abs=ATOL), p
    prompt_n = len(prompt_ids)
    assert lp["text_offset"][:prompt_n] == [len(tok.decode(prompt_ids[:k])) for k in range(prompt_n)]
    assert lp["text_offset"][prompt_n] == len(PROMPT)  # the output's first token starts after the echoed prompt
    for k, start in enumerate(lp["text_offset"]):
        assert text[start:start + len(lp["tokens"][k])] == lp["tokens"][k]


def test_echo_of_token_ids_and_prompt_scoring(sample_http: httpx.Client, sample_engine: Engine,
                                              oracle: Callable[[list[int]], torch.Tensor]) -> None:
    """A token-id prompt echoes as its decoded text; max_tokens=0 with echo scores the prompt alone."""
    tok = sample_engine.tokenizer
    ids = tok.encode("return fib(n - 1) + fib(n - 2)")
    body = {"prompt": ids, "max_tokens": 0, "logprobs": 0, "echo": True}
    choice = sample_http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == tok.decode(ids)
    lp = choice["logprobs"]
    ref = oracle(ids)
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))],
                                                     abs=ATOL)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])  # logprobs 0: the chosen token only


def test_streamed_logprobs_add_up_to_the_whole(sample_http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2, "echo": True, **SEEDED}
    whole = sample_http.post("/v1/completions", json=body).json()["choices"][0]
    chunks = [c["choices"][0] for c in stream_json(sample_http, "/v1/completions", body)]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    joined: dict[str, list[Any]] = {k: [] for k in whole["logprobs"]}
    for c in chunks:
        for k in joined:
            joined[k] += c["logprobs"][k]
    assert joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert joined["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=ATOL)


CHAT = {"messages": [{"role": "user", "content": "Write fib in Python."}], "max_tokens": 6, **SEEDED}


def test_chat_logprobs(sample_http: httpx.Client, sample_engine: Engine) -> None:
    from r3trace.server.chat import render_chat
    from r3trace.server.openai_requests import ChatMessage

    choice = sample_http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": TOP}
                              ).json()["choices"][0]
    prompt = render_chat([ChatMessage(**m) for m in CHAT["messages"]], None)  # the sample has no chat template
    want = sample_engine.generate(prompt=prompt, sampling_params={**SEEDED, "max_new_tokens": 6},
                                  return_logprob=True, top_logprobs_num=TOP)
    assert isinstance(want, dict)
    content = choice["logprobs"]["content"]
    out = want["meta_info"]["output_token_logprobs"]
    assert [c["logprob"] for c in content] == pytest.approx([v for v, _, _ in out], abs=ATOL)
    tok = sample_engine.tokenizer
    for c, (_, t, _), top in zip(content, out, want["meta_info"]["output_top_logprobs"], strict=True):
        assert c["token"] == tok.decode([t]) and bytes(c["bytes"]) == tok.token_bytes(t)
        assert [e["token"] for e in c["top_logprobs"]] == [tok.decode([i]) for _, i, _ in top]
        assert [e["logprob"] for e in c["top_logprobs"]] == pytest.approx([v for v, _, _ in top], abs=ATOL)
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == choice["message"]["content"]
    streamed = [c["choices"][0] for c in stream_json(sample_http, "/v1/chat/completions",
                                                   {**CHAT, "logprobs": True, "top_logprobs": TOP})]
    assert [e["token"] for c in streamed for e in c["logprobs"]["content"]] == [c["token"] for c in content]
    plain = sample_http.post("/v1/chat/completions", json={**CHAT, "top_logprobs": TOP}).json()["choices"][0]
    assert plain["logprobs"] is None  # top_logprobs without logprobs: ignored, as SGLang


def test_token_bytes_join_where_a_token_splits_a_character(sample_engine: Engine) -> None:
    """A byte-level BPE token may end inside a UTF-8 character: its text is U+FFFD, its bytes exact."""
    tok = sample_engine.tokenizer
    ids = tok.encode("héllo wörld 中")
    assert any(tok.decode([t]) == "\ufffd" for t in ids)
    assert b"".join(tok.token_bytes(t) for t in ids).decode() == "héllo wörld 中"


def test_generate_return_text_in_logprobs(sample_http: httpx.Client, sample_engine: Engine) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": 0}
    plain = sample_http.post("/generate", json=body).json()["meta_info"]
    named = sample_http.post("/generate", json={**body, "return_text_in_logprobs": True}).json()["meta_info"]
    tok = sample_engine.tokenizer
    assert all(e[2] is None for e in plain["output_token_logprobs"])
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [e[2] for e in named[key]] == [tok.decode([e[1]]) for e in plain[key]]
    assert named["output_top_logprobs"][0][1][2] == tok.decode([plain["output_top_logprobs"][0][1][1]])
    assert named["input_top_logprobs"][0] is None


def test_the_official_openai_client(sample_server: Any) -> None:
    """openai-python (a test extra) reads the logprobs into its own models (Completion, ChatCompletion)."""
    import openai
    client = openai.OpenAI(base_url=f"{sample_server.url}/v1", api_key="unused")
    done = client.completions.create(model="sample", prompt=PROMPT, max_tokens=4, logprobs=2, echo=True, n=2,
                                     seed=5, temperature=1.0)
    assert [c.index for c in done.choices] == [0, 1]
    assert done.choices[0].text.startswith(PROMPT) and done.choices[0].logprobs.token_logprobs[0] is None
    chat = client.chat.completions.create(model="sample", messages=CHAT["messages"], max_tokens=4, logprobs=True,
                                          top_logprobs=2)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    chunks = list(client.chat.completions.create(model="sample", messages=CHAT["messages"], max_tokens=4,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and all(c.usage is None for c in chunks[:-1])


def test_special_tokens_named_when_the_request_keeps_them(sample_engine: Engine) -> None:
    """skip_special_tokens=false keeps special tokens in the choice's text, so their logprob entries name them."""
    from r3trace.server.logprobs import TokenText

    tok = sample_engine.tokenizer
    eos = (-1.0, 0, None)  # the sample's <|endoftext|>, special in its tokenizer.json
    skipping, keeping = TokenText(tok), TokenText(tok).keeping_specials(True)
    assert (skipping.text(eos), skipping.bytes(eos)) == ("", [])
    assert (keeping.text(eos), bytes(keeping.bytes(eos))) == ("<|endoftext|>", b"<|endoftext|>")
    plain = (-1.0, tok.encode(" return")[0], None)
    assert keeping.text(plain) == skipping.text(plain) == tok.decode([plain[1]]) != ""



def test_echo_and_tokens_keep_special_tokens_when_asked(sample_http: httpx.Client, sample_engine: Engine) -> None:
    """skip_special_tokens=false: the echoed token-id prompt and its logprob tokens both show <|endoftext|> (id 0),
    and every token's text sits at its text_offset; by default both skip it."""
    tok = sample_engine.tokenizer
    ids = [0, *tok.encode("x = 1")]
    body = {"prompt": ids, "max_tokens": 0, "logprobs": 0, "echo": True}
    for keep, first in ((False, ""), (True, "<|endoftext|>")):
        choice = sample_http.post("/v1/completions", json={**body, "skip_special_tokens": not keep}).json()[
            "choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == first + "x = 1" and lp["tokens"][0] == first
        for k, start in enumerate(lp["text_offset"]):
            assert choice["text"][start:start + len(lp["tokens"][k])] == lp["tokens"][k]
