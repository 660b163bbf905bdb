"""sampling_params.stream_interval on /generate streams: a chunk every k output tokens, and the last one.

The contract, read (not copied) from sgl-project/sglang:
- python/sglang/srt/managers/scheduler_output_processor_mixin.py at 004ec010d0292427acff6a0003fd5fd4c91fb356
  (stream_output_generation): a streaming request with `req.sampling_params.stream_interval or
  self.stream_interval` = k outputs when len(output_ids) % k == 1 for k > 1 (== 0 for k == 1: every token); a
  finished request always outputs;
- python/sglang/srt/sampling/sampling_params.py at 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03: `stream_interval`, a
  sampling parameter (none by default).
Each chunk carries what the held steps added (joined), so the text, ids, logprobs and routes are those of a whole
answer.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/server/test_stream_interval.py
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import pytest

from r3trace.client import decode_routed_experts

IDS = [11, 12, 13, 14, 15, 16]
SP = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def _stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        text = r.read().decode()
    return [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e and e != "data: [DONE]"]


@pytest.mark.parametrize(("k", "lengths"), [(3, [1, 4, 7, 10]), (4, [1, 5, 9, 10]), (1, list(range(1, 11))),
                                            (20, [1, 10])])
def test_cumulative_chunks_every_k_tokens(http: httpx.Client, k: int, lengths: list[int]) -> None:
    body = {"input_ids": IDS, "sampling_params": {**SP, "stream_interval": k}, "return_logprob": True}
    whole = http.post("/generate", json=body).json()
    chunks = _stream(http, body)
    assert [len(c["output_ids"]) for c in chunks] == lengths
    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert [t for _, t, _ in last["meta_info"]["output_token_logprobs"]] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_incremental_chunks_join_the_held_steps(http: httpx.Client) -> None:
    body = {"input_ids": IDS, "sampling_params": {**SP, "stream_interval": 4}, "return_routed_experts": True,
            "return_logprob": True, "incremental_streaming_output": True}
    whole = http.post("/generate", json={k: v for k, v in body.items() if k != "incremental_streaming_output"}).json()
    chunks = _stream(http, body)
    assert [len(c["output_ids"]) for c in chunks] == [1, 4, 4, 1]
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    lps = sum((c["meta_info"]["output_token_logprobs"] for c in chunks), [])
    assert [t for _, t, _ in lps] == whole["output_ids"]
    offset, parts = 0, []
    for c in chunks:
        assert c["meta_info"]["routed_experts_offset"] == offset  # one block per chunk, rows in order
        parts.append(decode_routed_experts(c["meta_info"]))
        offset += len(parts[-1])
    np.testing.assert_array_equal(np.concatenate(parts), decode_routed_experts(whole["meta_info"]))


def test_each_choice_its_own_interval(http: httpx.Client) -> None:
    body = {"input_ids": [IDS, IDS[::-1]], "sampling_params": [{**SP, "stream_interval": 5}, SP]}
    chunks = _stream(http, body)
    by_choice = {i: [len(c["output_ids"]) for c in chunks if c["index"] == i] for i in (0, 1)}
    assert by_choice == {0: [1, 6, 10], 1: list(range(1, 11))}
