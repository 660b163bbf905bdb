"""token_ids_logprob: the logprobs of listed token ids at every returned position, as SGLang returns them.

SGLang's contract, read (not copied) from sgl-project/sglang: python/sglang/srt/managers/io_struct.py at
001067fffe33427bee0ed2f007fb7551a1d76b44 (GenerateReqInput.token_ids_logprob: one id list, or one per request);
python/sglang/srt/managers/tokenizer_manager.py (convert_logprob_style: with return_logprob, meta_info
`input_token_ids_logprobs` / `output_token_ids_logprobs` are built like the top lists, per position the entries
(logprob, id, text) of the listed ids in the order given; the first prompt position, which nothing predicts, None).

The oracle is the engine's own full distribution: top_logprobs_num = VOCAB lists every id's logprob at each
position from the same log_softmax, so the listed ids' values must equal those entries exactly.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_token_ids_logprob.py
"""

from __future__ import annotations

from typing import Any

import pytest

from r3trace.engine.request import InvalidRequestError
from tests.engine.conftest import VOCAB, EngineFactory, greedy, random_prompts

IDS = [7, 300, 2, 7, 155]  # a repeat and out-of-order ids: entries follow the given order


def _by_id(top: list[Any]) -> dict[int, float]:
    return {t[1]: t[0] for t in top}


def _expected(tops: list[Any], ids: list[int]) -> list[Any]:
    return [None if top is None else [(_by_id(top)[t], t, None) for t in ids] for top in tops]


def test_listed_ids_equal_the_full_distribution(make_engine: EngineFactory) -> None:
    """A batch of three: prompt positions from 0 (first None) and output positions, each request's own list (one
    without), with chunked prefill splitting the prompts so several steps mix prompt and sample rows."""
    engine = make_engine(chunked_prefill_size=16)
    prompts = random_prompts(3, 9, 23, seed=5)
    lists: list[list[int] | None] = [IDS, None, [319, 0]]
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(6), return_logprob=True, logprob_start_len=0,
                           top_logprobs_num=VOCAB, token_ids_logprob=lists)
    assert isinstance(outs, list)
    for out, ids, prompt in zip(outs, lists, prompts, strict=True):
        meta = out["meta_info"]
        if ids is None:
            assert "input_token_ids_logprobs" not in meta and "output_token_ids_logprobs" not in meta
            continue
        assert len(meta["input_token_ids_logprobs"]) == len(prompt) and meta["input_token_ids_logprobs"][0] is None
        assert meta["input_token_ids_logprobs"] == _expected(meta["input_top_logprobs"], ids)
        assert len(meta["output_token_ids_logprobs"]) == 6
        assert meta["output_token_ids_logprobs"] == _expected(meta["output_top_logprobs"], ids)


def test_shared_list_stream_and_defaults(make_engine: EngineFactory) -> None:
    """One list for every request of a batch; a stream's chunks join to the whole result's entries; default
    logprob_start_len (the last prompt position only); absent without return_logprob, as SGLang."""
    engine = make_engine()
    prompts = random_prompts(2, 5, 9, seed=8)
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(4), return_logprob=True, top_logprobs_num=VOCAB,
                           token_ids_logprob=IDS)
    assert isinstance(outs, list)
    for out in outs:
        meta = out["meta_info"]
        assert len(meta["input_token_ids_logprobs"]) == 1
        assert meta["input_token_ids_logprobs"] == _expected(meta["input_top_logprobs"], IDS)
        assert meta["output_token_ids_logprobs"] == _expected(meta["output_top_logprobs"], IDS)
    one = engine.generate(input_ids=prompts[0], sampling_params=greedy(4), return_logprob=True,
                          token_ids_logprob=IDS)
    assert isinstance(one, dict)
    chunks = list(engine.generate(input_ids=prompts[0], sampling_params=greedy(4), return_logprob=True,
                                  token_ids_logprob=IDS, stream=True))
    joined = sum((c["meta_info"]["output_token_ids_logprobs"] for c in chunks), [])
    assert len(chunks) > 1 and joined == one["meta_info"]["output_token_ids_logprobs"]
    assert chunks[0]["meta_info"]["input_token_ids_logprobs"] == one["meta_info"]["input_token_ids_logprobs"]
    assert all("input_token_ids_logprobs" not in c["meta_info"] for c in chunks[1:])
    plain = engine.generate(input_ids=prompts[0], sampling_params=greedy(2), token_ids_logprob=IDS)
    assert isinstance(plain, dict) and "output_token_ids_logprobs" not in plain["meta_info"]


@pytest.mark.parametrize("value, fragment", [
    ([VOCAB], f"outside the vocabulary 0..{VOCAB - 1}"),
    ([-1], "outside the vocabulary"),
    ([True], "must be a list of token ids"),
    ("7", "must be a list of token ids"),
])
def test_bad_ids_name_the_field(make_engine: EngineFactory, value: Any, fragment: str) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="token_ids_logprob") as err:
        engine.generate(input_ids=[5, 6, 7], sampling_params=greedy(1), return_logprob=True, token_ids_logprob=value)
    assert fragment in str(err.value)
