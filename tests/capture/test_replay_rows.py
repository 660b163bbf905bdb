"""Which rows a routing replay forces: every computed row by default, an explicit range for a partial replay.

docs/replay.md is the contract. A request computes prompt + max_new_tokens - 1 rows (the last sampled token is
returned, never forwarded; prompt rows only at max_new_tokens = 0); full-replay routes must cover all of them,
`routed_experts_replay_start_len=s` forces the n rows given at positions [s, s + n) and routes the rest freely.

Run: .venv/bin/pytest -q tests/capture/test_replay_rows.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from r3trace.engine import InvalidRequestError
from tests.capture.helpers import direct_routes, returned_routes
from tests.engine.conftest import EngineFactory, greedy, random_prompts

K, E, MOE = 3, 8, [1, 2]  # bench/tiny_models.py v3_noaux_groups: 3 layers, layer 0 dense


def random_routes(rows: int, seed: int) -> np.ndarray:
    """[rows, L, K] int32: K distinct experts per row and MoE layer (seeded), -1 on the dense layer."""
    rng = np.random.default_rng(seed)
    out = np.full((rows, 3, K), -1, np.int32)
    for r in range(rows):
        for layer in MOE:
            out[r, layer] = rng.choice(E, size=K, replace=False)
    return out


def test_routes_must_cover_every_computed_row(make_engine: EngineFactory) -> None:
    engine = make_engine()
    p = random_prompts(1, 6, 6, seed=20)[0]
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(input_ids=p, sampling_params=greedy(8), routed_experts=random_routes(2, 0))
    assert str(info.value) == (
        "routed_experts: 2 rows given, this request computes 13 (prompt 6 + max_new_tokens 8 - 1); give all 13, "
        "or pass routed_experts_replay_start_len to force only rows [start, start + 2) (partial replay)"
    )
    with pytest.raises(InvalidRequestError, match="12 rows given, this request computes 13 .* lower max_new_tokens"):
        engine.generate(input_ids=p, sampling_params=greedy(8), routed_experts=random_routes(12, 0))
    # 13 rows replay every computed row; a 14th (the last sampled token's, as a forward over the whole final
    # sequence records it) is accepted and never used; a 15th is refused.
    forced = random_routes(14, 1)
    a = engine.generate(input_ids=p, sampling_params=greedy(8), routed_experts=forced[:13], return_routed_experts=True)
    b = engine.generate(input_ids=p, sampling_params=greedy(8), routed_experts=forced, return_routed_experts=True)
    np.testing.assert_array_equal(returned_routes(a), forced[:13])
    np.testing.assert_array_equal(returned_routes(b), forced[:13])
    assert a["output_ids"] == b["output_ids"]
    with pytest.raises(InvalidRequestError, match="15 rows given; this request computes 13 .* rows \\[0, 14\\) at"):
        engine.generate(input_ids=p, sampling_params=greedy(8), routed_experts=random_routes(15, 0))
    # prefill only: every prompt row is computed, and nothing past it
    with pytest.raises(InvalidRequestError, match="5 rows given, this request computes 6 \\(prompt 6, max_new_tokens"):
        engine.generate(input_ids=p, sampling_params=greedy(0), routed_experts=random_routes(5, 0))
    with pytest.raises(InvalidRequestError, match="7 rows given; this request computes 6"):
        engine.generate(input_ids=p, sampling_params=greedy(0), routed_experts=random_routes(7, 0))


@pytest.mark.parametrize("empty", ["", b"", [], np.zeros((0, 3, K), np.int32)], ids=["str", "bytes", "list", "array"])
def test_empty_routes_are_an_error(make_engine: EngineFactory, empty: object) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="routed_experts: 0 rows given \\(empty\\); this request computes 7"):
        engine.generate(input_ids=[5, 6, 7, 8], sampling_params=greedy(4), routed_experts=empty)


def test_context_limit_caps_the_rows(make_engine: EngineFactory) -> None:
    """A request stops at max_context_len - 1 forwarded positions, whatever max_new_tokens says."""
    engine = make_engine(max_context_len=20)
    p = random_prompts(1, 15, 15, seed=21)[0]
    with pytest.raises(InvalidRequestError, match="computes 19 \\(prompt 15 \\+ max_new_tokens 30 - 1, capped at "
                                                  "max_context_len 20 - 1\\)"):
        engine.generate(input_ids=p, sampling_params=greedy(30), routed_experts=random_routes(18, 0))
    forced = random_routes(19, 2)
    out = engine.generate(input_ids=p, sampling_params=greedy(30), routed_experts=forced, return_routed_experts=True)
    assert len(out["output_ids"]) == 5
    np.testing.assert_array_equal(returned_routes(out), forced)


def test_a_request_that_stops_early_uses_the_rows_it_reaches(make_engine: EngineFactory) -> None:
    engine = make_engine()
    p = random_prompts(1, 7, 7, seed=22)[0]
    forced = random_routes(7 + 10 - 1, 3)
    kw = dict(input_ids=p, routed_experts=forced, return_routed_experts=True)
    full = engine.generate(sampling_params=greedy(10), **kw)
    stop = full["output_ids"][3]  # the 4th token the forced routes lead to
    assert stop not in full["output_ids"][:3]
    early = engine.generate(sampling_params=greedy(10, stop_token_ids=[stop], ignore_eos=False), **kw)
    assert early["output_ids"] == full["output_ids"][:4]
    assert early["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    np.testing.assert_array_equal(returned_routes(early), forced[: 7 + 4 - 1])


def test_partial_replay_forces_only_its_range(tiny_ckpt: Path, make_engine: EngineFactory) -> None:
    """Rows [s, s + n) forced, the rest routed by the gate: before s the routes are a direct forward's of the
    same tokens; after s + n they follow from the forced history (tests/engine/test_replay_oracle.py checks those
    against transformers). The prompt crosses a chunk boundary and the range spans prompt and decode rows."""
    engine = make_engine(chunked_prefill_size=8, page_size=4)
    p = random_prompts(1, 12, 12, seed=23)[0]
    s, n = 9, 6  # positions 9..14: prompt rows 9..11, decode rows 12..14 (of 12 + 6 - 1 = 17)
    forced = random_routes(n, 4)
    out = engine.generate(input_ids=p, sampling_params=greedy(6), routed_experts=forced,
                          routed_experts_replay_start_len=s, return_routed_experts=True)
    got = returned_routes(out)
    assert got.shape == (17, 3, K)
    np.testing.assert_array_equal(got[s : s + n], forced)
    np.testing.assert_array_equal(got[:s], direct_routes(tiny_ckpt, p[:s]))
    natural = returned_routes(engine.generate(input_ids=p, sampling_params=greedy(6), return_routed_experts=True))
    assert (got[s + n :] != natural[s + n :]).any(), "the forced rows changed what came after them"
    # a list gives one start per request; a request without routes takes None
    outs = engine.generate(input_ids=[p, p], sampling_params=greedy(6), routed_experts=[forced, None],
                           routed_experts_replay_start_len=[s, None], return_routed_experts=True)
    np.testing.assert_array_equal(returned_routes(outs[0]), got)
    np.testing.assert_array_equal(returned_routes(outs[1]), natural)


@pytest.mark.parametrize(
    ("routes", "start", "needle"),
    [
        (None, 0, "routed_experts_replay_start_len: 0 given without routed_experts to replay"),
        (random_routes(3, 0), -1, "routed_experts_replay_start_len: -1 must be an integer >= 0"),
        (random_routes(3, 0), True, "routed_experts_replay_start_len: True must be an integer >= 0"),
        (random_routes(3, 0), 12, "routed_experts: rows [12, 15) given; this request computes 13 (prompt 6 + "
                                  "max_new_tokens 8 - 1), rows [0, 14) at most"),
    ],
)
def test_bad_partial_replay_is_an_error(make_engine: EngineFactory, routes: object, start: object,
                                        needle: str) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(input_ids=[5, 6, 7, 8, 9, 10], sampling_params=greedy(8), routed_experts=routes,
                        routed_experts_replay_start_len=start)
    assert needle in str(info.value)
