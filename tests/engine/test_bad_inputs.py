"""Bad inputs fail that request alone, with an error naming the field; the engine keeps serving.

Run: .venv/bin/pytest -q tests/engine/test_bad_inputs.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.tiny_models import make_checkpoint
from r3trace.engine import Engine, InvalidRequestError
from tests.engine.conftest import VOCAB, EngineFactory, assert_pool_whole, greedy

GOOD = [5, 6, 7, 8]

BAD: list[tuple[dict[str, Any], str, str]] = [
    (dict(prompt=""), "prompt", "empty"),
    (dict(input_ids=[]), "input_ids", "empty"),
    (dict(input_ids=[5, VOCAB, 6]), "input_ids", "token id 320 at index 1 outside the vocabulary 0..319"),
    (dict(input_ids=[5, -1]), "input_ids", "token id -1"),
    (dict(input_ids=[5, "x"]), "input_ids", "integer token ids"),
    (dict(input_ids=list(range(2, 42))), "input_ids",
     "40 tokens do not fit the KV pool of kv_pool_tokens=32"),
    (dict(prompt="a", input_ids=[3]), "prompt", "exactly one"),
    (dict(input_ids=GOOD, sampling_params={"temperature": -0.5}), "sampling_params.temperature", "-0.5"),
    (dict(input_ids=GOOD, sampling_params={"top_p": 0.0}), "sampling_params.top_p", "(0, 1]"),
    (dict(input_ids=GOOD, sampling_params={"top_k": 0}), "sampling_params.top_k", "-1"),
    (dict(input_ids=GOOD, sampling_params={"max_new_tokens": -1}), "sampling_params.max_new_tokens", ">= 0"),
    (dict(input_ids=GOOD, sampling_params={"max_new_tokens": 2.5}), "sampling_params.max_new_tokens", "2.5"),
    (dict(input_ids=GOOD, sampling_params={"seed": "x"}), "sampling_params.seed", "'x'"),
    (dict(input_ids=GOOD, sampling_params={"stop": [""]}), "sampling_params.stop", "non-empty"),
    (dict(input_ids=GOOD, sampling_params={"stop_token_ids": [VOCAB]}), "sampling_params.stop_token_ids",
     str(VOCAB)),
    (dict(input_ids=GOOD, sampling_params={"temprature": 0}), "sampling_params.temprature", "unknown"),
    (dict(input_ids=GOOD, sampling_params="greedy"), "sampling_params", "dict"),
    (dict(input_ids=GOOD, return_logprob=True, logprob_start_len=4), "logprob_start_len", "0..3"),
    (dict(input_ids=GOOD, return_logprob=True, top_logprobs_num=-2), "top_logprobs_num", "-2"),
]


@pytest.fixture
def engine(make_engine: EngineFactory) -> Engine:
    return make_engine(kv_pool_tokens=32, page_size=4, max_context_len=48, chunked_prefill_size=8)


@pytest.mark.parametrize("kwargs,field,detail", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_single_bad_request_raises_then_engine_serves(engine: Engine, kwargs: dict, field: str,
                                                      detail: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(**kwargs)
    assert info.value.field == field and detail in str(info.value), str(info.value)
    assert engine.generate(input_ids=GOOD, sampling_params=greedy(3))["meta_info"]["completion_tokens"] == 3


def test_prompt_longer_than_the_context(make_engine: EngineFactory) -> None:
    e = make_engine(max_context_len=16)
    msg = "16 tokens leave no room to generate in max_context_len=16"
    with pytest.raises(InvalidRequestError, match=msg):
        e.generate(input_ids=list(range(2, 18)))
    out = e.generate(input_ids=list(range(2, 12)), sampling_params=greedy(50))
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}  # stopped by the context


def test_bad_entries_in_a_list_fail_alone(engine: Engine) -> None:
    out = engine.generate(
        input_ids=[GOOD, [], [5, 999], GOOD[:2]],
        sampling_params=[greedy(3), greedy(3), greedy(3), {"top_p": 2.0}],
    )
    assert isinstance(out, list) and len(out) == 4
    assert out[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 3} and "error" not in out[0]
    for bad, field in zip(out[1:], ["input_ids", "input_ids", "sampling_params.top_p"], strict=True):
        assert bad["meta_info"]["finish_reason"]["type"] == "abort"
        assert bad["error"].startswith(field) and bad["error"] == bad["meta_info"]["finish_reason"]["message"]
        assert bad["output_ids"] == []
    with pytest.raises(InvalidRequestError, match="sampling_params: a list of 1 values for 2"):
        engine.generate(input_ids=[GOOD, GOOD], sampling_params=[greedy(1)])


def test_generation_outgrowing_the_pool_aborts_that_request(engine: Engine) -> None:
    """A 32-slot pool: alone, a 20-token prompt cannot grow past 32 tokens; it ends with an error,
    keeps what it generated, and the others in the list finish."""
    out = engine.generate(input_ids=[list(range(2, 22)), GOOD], sampling_params=[greedy(40), greedy(3)])
    assert isinstance(out, list)
    big, small = out
    assert big["meta_info"]["finish_reason"]["type"] == "abort" and "KV pool exhausted" in big["error"]
    assert 0 < big["meta_info"]["completion_tokens"] < 40
    assert small["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert engine.generate(input_ids=GOOD, sampling_params=greedy(2))["meta_info"]["completion_tokens"] == 2
    assert_pool_whole(engine)


def test_small_vocab_has_no_byte_tokenizer(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "v200", "v3_noaux_groups", seed=0, vocab_size=200)
    with Engine(ckpt) as e:
        with pytest.raises(InvalidRequestError, match="vocab_size=200 < 256") as info:
            e.generate("hello")
        assert info.value.field == "prompt"
        assert len(e.generate(input_ids=[3, 4, 5], sampling_params=greedy(3))["output_ids"]) == 3
