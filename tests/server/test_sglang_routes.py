"""Routes in the shapes SGLang's consumers read: meta_info's echoed start_len.

Contracts, as read from SGLang's source (sgl-project/sglang):
- python/sglang/srt/managers/tokenizer_manager.py @ c60799d0eb1b537e3fa09e45fc5c91b5861de957 (`_handle_batch_output`):
  route fields are flat keys of meta_info (`meta_info["routed_experts"]`, base64).
- slime's multi-turn append reads `meta_info.get("routed_experts_start_len", 0)` back and places the rows there.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/server/test_sglang_routes.py
"""

from __future__ import annotations

import httpx

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

