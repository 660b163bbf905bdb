"""`r3trace serve` over a speculative engine: /generate (whole and streamed, routes included) and the OpenAI
completions endpoint return what the plain engine returns, and routing replay of captured routes holds under
speculation.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_spec_server.py
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np

from r3trace import decode_routed_experts
from r3trace.server import ServerConfig, create_app
from tests.engine.conftest import EngineFactory
from tests.server.live_server import LiveServer

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def test_server_over_a_speculative_engine(make_spec_engine: EngineFactory, mtp_ckpt: Path, tmp_path: Path) -> None:
    spec = make_spec_engine(model=mtp_ckpt, deterministic=True, speculative_algorithm="NEXTN")
    plain = make_spec_engine(model=mtp_ckpt, deterministic=True)
    body = {"input_ids": [11, 12, 13, 14, 15, 16], "sampling_params": GREEDY, "return_routed_experts": True}
    want = plain.generate(input_ids=body["input_ids"], sampling_params=GREEDY, return_routed_experts=True)
    cfg = ServerConfig(model_name="tiny-mtp", trace_root=tmp_path)
    with LiveServer(create_app(spec, cfg)) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        whole = http.post("/generate", json=body).json()
        with http.stream("POST", "/generate", json={**body, "stream": True, "incremental_streaming_output": True}) as r:
            events = [json.loads(e.removeprefix("data: ")) for e in r.read().decode().split("\n\n")
                      if e and e != "data: [DONE]"]
        completion = http.post("/v1/completions", json={
            "prompt": body["input_ids"], "max_tokens": 10, "temperature": 0, "return_routed_experts": True,
            "ignore_eos": True}).json()
    assert whole["output_ids"] == want["output_ids"]
    assert whole["meta_info"]["spec_verify_ct"] < len(want["output_ids"]) - 1, "no verify accepted a draft"
    np.testing.assert_array_equal(decode_routed_experts(whole["meta_info"]), decode_routed_experts(want["meta_info"]))
    assert sum((e["output_ids"] for e in events), []) == want["output_ids"]
    parts = [decode_routed_experts(e["meta_info"]) for e in events if e["meta_info"].get("routed_experts")]
    np.testing.assert_array_equal(np.concatenate(parts), decode_routed_experts(want["meta_info"]))
    np.testing.assert_array_equal(decode_routed_experts(completion["sglext"]), decode_routed_experts(want["meta_info"]))


def test_replay_of_captured_routes_under_speculation(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """Routes captured with speculation, replayed with speculation: the forced rows include draft positions of verify
    forwards (positions past the accepted ones are forced too, and dropped); tokens and routes come back the same."""
    spec = make_spec_engine(model=mtp_ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3)
    ids = [[7, 8, 9, 10, 11], [20, 21, 22]]
    first = spec.generate(input_ids=ids, sampling_params=GREEDY, return_routed_experts=True)
    again = spec.generate(input_ids=ids, sampling_params=GREEDY, return_routed_experts=True,
                          routed_experts=[f["meta_info"]["routed_experts"] for f in first])
    for a, b in zip(first, again, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["routed_experts"] == b["meta_info"]["routed_experts"]
        assert b["meta_info"]["spec_num_correct_drafts"] > 0
