"""Routing replay over HTTP: routes that do not cover the request are a 400 naming the counts; full and partial
replays force exactly the rows they name (docs/replay.md).

Run: .venv/bin/pytest -q tests/server/test_replay_http.py
"""

from __future__ import annotations

import httpx
import numpy as np

from r3trace import decode_routed_experts
from r3trace.capture.wire import encode_int32

PROMPT = [21, 22, 23, 24, 25, 26]
GREEDY8 = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def random_routes(rows: int, seed: int) -> np.ndarray:
    """[rows, 3, 3] int32 for tests/server/conftest.py's v3_noaux_groups model: 3 distinct of 8 experts per
    MoE layer (1 and 2), -1 on the dense layer 0."""
    rng = np.random.default_rng(seed)
    out = np.full((rows, 3, 3), -1, np.int32)
    for r in range(rows):
        for layer in (1, 2):
            out[r, layer] = rng.choice(8, size=3, replace=False)
    return out


def post(http: httpx.Client, **body: object) -> httpx.Response:
    return http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY8, **body})


def test_short_or_empty_routes_are_a_400_naming_the_counts(http: httpx.Client) -> None:
    r = post(http, routed_experts=encode_int32(random_routes(2, 0)))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "routed_experts"
    assert err["message"] == (
        "routed_experts: 2 rows given, this request computes 13 (prompt 6 + max_new_tokens 8 - 1); give all 13, "
        "or pass routed_experts_replay_start_len to force only rows [start, start + 2) (partial replay)"
    )
    r = post(http, routed_experts="")
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("routed_experts: 0 rows given (empty)")
    r = post(http, routed_experts_replay_start_len=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "routed_experts_replay_start_len"
    r = post(http, routed_experts=encode_int32(random_routes(2, 0)), routed_experts_replay_start_len=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "routed_experts_replay_start_len"
    assert post(http).status_code == 200  # the server keeps serving


def test_full_and_partial_replay_force_the_rows_they_name(http: httpx.Client) -> None:
    forced = random_routes(13, 1)
    full = post(http, routed_experts=encode_int32(forced), return_routed_experts=True)
    assert full.status_code == 200, full.text
    np.testing.assert_array_equal(decode_routed_experts(full.json()["meta_info"]), forced)
    part = post(http, routed_experts=encode_int32(forced[4:9]), routed_experts_replay_start_len=4,
                return_routed_experts=True)
    assert part.status_code == 200, part.text
    got = decode_routed_experts(part.json()["meta_info"])
    natural = decode_routed_experts(post(http, return_routed_experts=True).json()["meta_info"])
    np.testing.assert_array_equal(got[4:9], forced[4:9])
    np.testing.assert_array_equal(got[:4], natural[:4])  # before the range: the gate's own routes
