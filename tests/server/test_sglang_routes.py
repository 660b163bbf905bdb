"""Routes in the shapes SGLang's consumers read: meta_info's echoed start_len, OpenAI's response-level `sglext`,
/generate streams that end with the whole routes.

Contracts, as read from SGLang's source (sgl-project/sglang):
- python/sglang/srt/managers/tokenizer_manager.py @ c60799d0eb1b537e3fa09e45fc5c91b5861de957 (`_handle_batch_output`):
  route fields are flat keys of meta_info (`meta_info["routed_experts"]`, base64); a stream is cumulative unless
  the server runs with `incremental_streaming_output`: every chunk's `text`/`output_ids` is the whole output so far.
- slime's multi-turn append reads `meta_info.get("routed_experts_start_len", 0)` back and places the rows there.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_sglang_routes.py
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from r3trace import decode_routed_experts
from r3trace.engine import Engine
from tests.server.sse import json_events

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
IDS = [31, 32, 33, 34, 35, 36]


def test_meta_info_echoes_start_len(engine: Engine, http: httpx.Client) -> None:
    for start in (0, 4):
        out = engine.generate(input_ids=IDS, sampling_params=GREEDY, return_routed_experts=True,
                              routed_experts_start_len=start)
        assert isinstance(out, dict)
        meta = out["meta_info"]
        assert meta["routed_experts_start_len"] == start
        assert decode_routed_experts(meta).shape[0] == len(IDS) + 4 - 1 - start  # rows start_len..
        got = http.post("/generate", json={"input_ids": IDS, "sampling_params": GREEDY, "return_routed_experts": True,
                                           "routed_experts_start_len": start}).json()["meta_info"]
        assert got["routed_experts_start_len"] == start
    plain = engine.generate(input_ids=IDS, sampling_params=GREEDY)
    assert isinstance(plain, dict) and "routed_experts_start_len" not in plain["meta_info"]  # only with routes


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": IDS}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_openai_routes_at_response_level_in_sglext(http: httpx.Client, path: str, extra: dict) -> None:
    """serving_completions.py @ 004c82e07d876f6e4a0ad6e15325706b0f478f1a and serving_chat.py @
    0c078e6f42685e4918bd79a94a025261c7f38942: `sglext=SglExt(routed_experts=...)` on the response, from the first
    result; a stream sends it once, in a chunk with `choices=[]` after the choice chunks. protocol.py @
    9b116dffe828b2dfa7ec0e4d061555b6c354b67a: SglExt drops unset fields."""
    body = {**extra, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_routed_experts": True,
            "routed_experts_start_len": 2}
    out = http.post(path, json=body).json()
    assert all("sgl_ext" not in c and "sglext" not in c for c in out["choices"])
    whole = decode_routed_experts(out["sglext"])
    prompt = out["usage"]["prompt_tokens"]
    assert whole.shape[0] == prompt + 4 - 1 - 2 and out["sglext"]["routed_experts_start_len"] == 2
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        chunks = json_events(r)
    with_routes = [i for i, c in enumerate(chunks) if "sglext" in c]
    assert with_routes == [len(chunks) - 1], "routes once, after every choice chunk"
    last = chunks[-1]
    assert last["choices"] == [] and "routed_experts_offset" not in last["sglext"]
    assert last["sglext"]["routed_experts_start_len"] == 2
    np.testing.assert_array_equal(decode_routed_experts(last["sglext"]), whole)
    assert last["sglext"]["routed_experts_shape"] == list(whole.shape)
    plain = http.post(path, json={**extra, "max_tokens": 2}).json()
    assert "sglext" not in plain


def test_openai_several_choices_each_in_sglext(http: httpx.Client, engine: Engine) -> None:
    prompts = [[41, 42, 43], [44, 45]]
    out = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 3, "temperature": 0,
                                             "ignore_eos": True, "return_routed_experts": True}).json()
    ext = out["sglext"]
    assert ext["routed_experts"] == ext["choices"][0]["routed_experts"]  # SGLang's reader: the first result's
    for i, p in enumerate(prompts):
        want = engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 3},
                               return_routed_experts=True)
        assert isinstance(want, dict) and ext["choices"][i]["index"] == i
        assert ext["choices"][i]["routed_experts"] == want["meta_info"]["routed_experts"]


def test_generate_stream_is_cumulative_with_routes_once_at_the_end(http: httpx.Client) -> None:
    """tokenizer_manager.py @ c60799d0eb1b537e3fa09e45fc5c91b5861de957: without --incremental-streaming-output
    (off by default) a chunk is `{"text": state.get_text(), "output_ids": state.output_ids, ...}`, the whole
    output so far; routed_experts is set on meta_info when the scheduler sends it, at the finish.
    server_args.py @ 469c63e54e7d94591617ef9590c6aa26d54dc1bb: `incremental_streaming_output: bool = False`."""
    body = {"input_ids": IDS, "sampling_params": {**GREEDY, "max_new_tokens": 5}, "return_routed_experts": True,
            "return_logprob": True}
    whole = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        chunks = json_events(r)
    assert len(chunks) > 2
    for a, b in zip(chunks, chunks[1:], strict=False):  # each chunk extends the previous one
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"] and b["text"].startswith(a["text"])
        assert "routed_experts" not in a["meta_info"]
    last = chunks[-1]["meta_info"]
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    got_lp, want_lp = last["output_token_logprobs"], whole["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in got_lp] == [t for _, t, _ in want_lp]  # every token's, not the last step's
    assert [lp for lp, _, _ in got_lp] == pytest.approx([lp for lp, _, _ in want_lp], abs=1e-4)
    assert last["routed_experts"] == whole["meta_info"]["routed_experts"]  # SGLang's reader: the last chunk
    assert last["routed_experts_shape"] == whole["meta_info"]["routed_experts_shape"]
    assert last["routed_experts_start_len"] == 0 and "routed_experts_offset" not in last


def test_generate_incremental_stream_is_opt_in(http: httpx.Client) -> None:
    body = {"input_ids": IDS, "sampling_params": {**GREEDY, "max_new_tokens": 5}, "return_routed_experts": True,
            "routed_experts_start_len": 3}
    whole = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True, "incremental_streaming_output": True}) as r:
        chunks = json_events(r)
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    offset, parts = 3, []
    for c in chunks:
        if "routed_experts" in c["meta_info"]:
            assert c["meta_info"]["routed_experts_offset"] == offset
            parts.append(decode_routed_experts(c["meta_info"]))
            offset += len(parts[-1])
    assert len(parts) > 2, "rows as they are computed, not one block at the end"
    np.testing.assert_array_equal(np.concatenate(parts), decode_routed_experts(whole["meta_info"]))
