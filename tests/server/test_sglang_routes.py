"""Routes in the shapes SGLang's consumers read: meta_info's echoed start_len, OpenAI's response-level `sglext`.

Contracts, as read from SGLang's source (sgl-project/sglang):
- python/sglang/srt/managers/tokenizer_manager.py @ c60799d0eb1b537e3fa09e45fc5c91b5861de957 (`_handle_batch_output`):
  route fields are flat keys of meta_info (`meta_info["routed_experts"]`, base64).
- slime's multi-turn append reads `meta_info.get("routed_experts_start_len", 0)` back and places the rows there.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/server/test_sglang_routes.py
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from r3trace import decode_routed_experts
from r3trace.engine import Engine

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


def _events(response: httpx.Response) -> list[dict]:
    body = response.read().decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    return [json.loads(e.removeprefix("data: ")) for e in body.split("\n\n") if e and e != "data: [DONE]"]


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
        chunks = _events(r)
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

