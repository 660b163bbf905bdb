"""Routing replay and the prefix cache: a replay reuses a cached prefix only where that is exact, and KV
computed with forced routes is never served to a request that routes freely (docs/replay.md).

Each replay is checked against the same request on an engine without a prefix cache (which computes every
position): same tokens, same routes, output logprobs within 1e-5 (fp32; a prefix hit changes only how the
positions are batched, which moved them by at most 2.2e-6 in bench/replay_prefix_cache.py).

Run: .venv/bin/pytest -q tests/capture/test_replay_prefix_cache.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from r3trace.engine import Engine
from tests.capture.helpers import assert_routes_exact, returned_routes
from tests.capture.test_replay_rows import random_routes
from tests.engine.conftest import EngineFactory, greedy, random_prompts

ATOL = 1e-5


def replay(engine: Engine, prompt: list[int], routes: np.ndarray, new: int) -> dict[str, Any]:
    """Force routes on positions [0, len(routes)), the rest routed freely; routes and logprobs returned."""
    out = engine.generate(input_ids=prompt, sampling_params=greedy(new), routed_experts=routes,
                          routed_experts_replay_start_len=0, return_routed_experts=True, return_logprob=True)
    assert isinstance(out, dict)
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["output_ids"] == b["output_ids"]
    np.testing.assert_array_equal(returned_routes(a), returned_routes(b))
    la = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
    lb = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
    np.testing.assert_allclose(la, lb, rtol=0, atol=ATOL)


def test_multi_turn_replay_reuses_the_turns_before(make_engine: EngineFactory) -> None:
    """Turn 1 routes freely (a rollout); turns 2 and 3 replay every earlier turn's routes. Pages of 4 slots:
    each turn recomputes the forced rows of its last partial page, and the next turn still reuses them."""
    engine, fresh = make_engine(page_size=4, chunked_prefill_size=16), make_engine(enable_prefix_cache=False)
    p1 = random_prompts(1, 13, 13, seed=30)[0]
    one = engine.generate(input_ids=p1, sampling_params=greedy(6), return_routed_experts=True)
    r1 = returned_routes(one)  # rows [0, 18)
    p2 = p1 + one["output_ids"] + [40, 41, 42, 43, 44]
    two = replay(engine, p2, r1, 5)
    assert two["meta_info"]["cached_tokens"] == 16  # 18 rows cached by turn 1, in whole pages
    assert_same(two, replay(fresh, p2, r1, 5))
    r2 = returned_routes(two)  # rows [0, 28)
    np.testing.assert_array_equal(r2[:18], r1)
    p3 = p2 + two["output_ids"] + [50, 51, 52]
    three = replay(engine, p3, r2, 4)
    assert three["meta_info"]["cached_tokens"] == 28  # turn 2's pages, forced rows 16, 17 included
    assert_same(three, replay(fresh, p3, r2, 4))
    np.testing.assert_array_equal(returned_routes(three)[:28], r2)
    assert three["meta_info"]["routed_experts_provenance"][0][:2] == [0, 28]


def test_a_replay_recomputes_from_the_first_differing_route(make_engine: EngineFactory) -> None:
    engine, fresh = make_engine(), make_engine(enable_prefix_cache=False)
    p = random_prompts(1, 12, 12, seed=31)[0]
    natural = returned_routes(engine.generate(input_ids=p, sampling_params=greedy(4), return_routed_experts=True))
    forced = natural.copy()
    forced[7, 2] = (forced[7, 2] + 1) % 8  # position 7's last MoE layer moves to other experts
    a = replay(engine, p + [60, 61], forced, 3)
    assert a["meta_info"]["cached_tokens"] == 7
    np.testing.assert_array_equal(returned_routes(a)[: len(forced)], forced)
    assert_same(a, replay(fresh, p + [60, 61], forced, 3))
    same_order = natural.copy()
    same_order[3, 1] = same_order[3, 1, ::-1]  # the same experts in another order are other routes too
    b = replay(engine, p + [62], same_order, 2)
    assert b["meta_info"]["cached_tokens"] == 3


def test_kv_of_forced_routes_serves_replays_only(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    engine, fresh = make_engine(), make_engine(enable_prefix_cache=False)
    p = random_prompts(1, 10, 10, seed=32)[0]
    forced = random_routes(10 + 6 - 1, 33)  # routes the gate would not pick
    first = engine.generate(input_ids=p, sampling_params=greedy(6), routed_experts=forced,
                            return_routed_experts=True)
    seq = p + first["output_ids"]
    # The cache holds KV computed with forced routes for seq[:15]: a replay of the same routes reuses it
    # (a partial replay: its last rows route freely) ...
    again = replay(engine, seq, forced, 4)
    assert again["meta_info"]["cached_tokens"] == 14  # of 15: the last prompt token's logprob needs row 14
    assert_same(again, replay(fresh, seq, forced, 4))
    # ... a request that routes freely does not, and its own copy replaces the forced one in the cache ...
    free = engine.generate(input_ids=seq[:13], sampling_params=greedy(3), return_routed_experts=True)
    assert free["meta_info"]["cached_tokens"] == 0
    assert_routes_exact(tiny_ckpt, seq[:13], free)
    # ... which the next free request reuses.
    later = engine.generate(input_ids=seq[:13] + [70], sampling_params=greedy(2), return_routed_experts=True)
    assert later["meta_info"]["cached_tokens"] == 13
    assert_routes_exact(tiny_ckpt, seq[:13] + [70], later)


def test_routes_nobody_captured_are_recomputed(make_engine: EngineFactory) -> None:
    """A hit is checked against the routes on the host; a prefix computed without capture has none."""
    engine = make_engine()
    p = random_prompts(1, 12, 12, seed=34)[0]
    routes = returned_routes(make_engine().generate(input_ids=p, sampling_params=greedy(4),
                                                    return_routed_experts=True))
    engine.generate(input_ids=p, sampling_params=greedy(4))  # the same tokens and routes, not captured
    out = engine.generate(input_ids=p + [80], sampling_params=greedy(2), routed_experts=routes,
                          routed_experts_replay_start_len=0)  # not capturing either: nothing else cuts the hit
    assert out["meta_info"]["cached_tokens"] == 0
    assert engine.generate(input_ids=p + [80], sampling_params=greedy(2))["meta_info"]["cached_tokens"] == 12
