"""logit_bias: token id -> bias added to a request's logits before sampling, per request, after the penalties.

The contract, read (not copied) from sgl-project/sglang:
- python/sglang/srt/sampling/sampling_params.py at 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03: SamplingParams carries
  `logit_bias: Optional[Dict[str, float]]`; verify() refuses a key outside [0, vocab_size - 1] (int(key));
- python/sglang/srt/sampling/sampling_batch_info.py at 009db01a7c0d5460611d543516401eb497641918: a [B, V] zero
  tensor with each request's biases at its keys, built only when a request of the batch has one, and
  apply_logits_bias adds it after the penalizers (so greedy rows are biased too).
OpenAI's range of a value is [-100, 100] (its API reference: "-100 should result in a ban ... 100 in exclusive
selection"); r3trace refuses values outside it, where SGLang checks none.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_logit_bias.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from r3trace.engine import Engine, InvalidRequestError
from r3trace.engine.host_staging import HostStaging
from r3trace.engine.penalties import Penalties, PenaltyRow
from r3trace.engine.request import SamplingParams
from tests.engine.conftest import EngineFactory, greedy, random_prompts

V = 40
STAGE = HostStaging("cpu").to_device


def test_bias_is_added_after_the_penalties_per_row() -> None:
    """Row 0: repetition penalty then its biases; row 1: no bias (untouched); row 2: only a bias. The step adds each
    bias at its own row and token, after the repetition penalty (SGLang's apply_logits_bias order)."""
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3  # [B, V]
    rows = [PenaltyRow(SamplingParams(repetition_penalty=1.5, logit_bias=((4, -100.0), (9, 2.5))), 0, 2, [4, 7]),
            PenaltyRow(SamplingParams(), 1, 0, []),
            PenaltyRow(SamplingParams(logit_bias=((0, 100.0), (39, -0.25))), 2, 0, [])]
    step = Penalties(num_rows=3, vocab=V, eos_token_ids=(), device="cpu").step(rows, STAGE)
    assert step is not None
    got = step.apply(logits)
    ref = logits.clone()
    for t in (4, 7):  # row 0's output tokens: repetition first
        ref[0, t] = ref[0, t] * 1.5 if ref[0, t] < 0 else ref[0, t] / 1.5
    ref[0, 4] -= 100.0
    ref[0, 9] += 2.5
    ref[2, 0] += 100.0
    ref[2, 39] -= 0.25
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)
    assert torch.equal(got[1], logits[1])


def test_no_bias_no_step() -> None:
    """The batch-level fast path: a batch without bias, penalty or min_new_tokens ahead gets no step; an empty
    logit_bias ({}) is no bias."""
    pen = Penalties(num_rows=2, vocab=V, eos_token_ids=(), device="cpu")
    rows = [PenaltyRow(SamplingParams.from_dict({"logit_bias": {}}), 0, 0, []), PenaltyRow(SamplingParams(), 1, 0, [])]
    assert pen.step(rows, STAGE) is None


def _first(engine: Engine, prompt: list[int], **sp: Any) -> dict[str, Any]:
    return engine.generate(input_ids=prompt, sampling_params=greedy(1, **sp), return_logprob=True,
                           top_logprobs_num=3)


def test_minus_100_moves_the_argmax_to_the_next_best_and_plus_100_forces(make_engine: EngineFactory) -> None:
    """Greedy: -100 on the greedy token makes the unbiased second-best token the output; +100 on the third-best token
    makes it every output token; a request without bias in the same batch gives its solo tokens."""
    engine = make_engine(max_running_requests=8)
    prompt = random_prompts(1, 6, 6, seed=4)[0]
    tops = _first(engine, prompt)["meta_info"]["output_top_logprobs"][0]  # [(logprob, id, None)] most likely first
    best, second, third = (t[1] for t in tops)
    banned = _first(engine, prompt, logit_bias={str(best): -100})
    assert banned["output_ids"] == [second]
    forced = engine.generate(input_ids=prompt, sampling_params=greedy(5, logit_bias={str(third): 100}))
    assert forced["output_ids"] == [third] * 5
    plain = engine.generate(input_ids=prompt, sampling_params=greedy(5))
    batch = engine.generate(input_ids=[prompt, prompt], sampling_params=[greedy(5, logit_bias={str(third): 100}),
                                                                         greedy(5)])
    assert [r["output_ids"] for r in batch] == [[third] * 5, plain["output_ids"]]
    assert plain["output_ids"][0] == best


def test_sampled_rows_are_biased_too(make_engine: EngineFactory) -> None:
    """Temperature 1 with a seed: +100 on one token leaves it the only token with mass (exp(-100) next to it)."""
    engine = make_engine(max_running_requests=4)
    out = engine.generate(input_ids=random_prompts(1, 5, 5, seed=2)[0],
                          sampling_params={"temperature": 1.0, "seed": 3, "max_new_tokens": 6, "ignore_eos": True,
                                           "logit_bias": {"17": 100}})
    assert out["output_ids"] == [17] * 6


@pytest.mark.parametrize(("bias", "why"), [
    ({"5": 100.5}, "must be in [-100, 100]"),
    ({"5": "1"}, "must be in [-100, 100]"),
    ({"abc": 1}, "not a token id"),
    ({"-3": 1}, "not a token id"),
    ([5, 1], "must be an object"),
])
def test_bad_bias_is_one_line_naming_the_field(bias: Any, why: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict({"logit_bias": bias})
    assert err.value.field == "sampling_params.logit_bias" and why in str(err.value), str(err.value)


def test_key_outside_the_vocabulary_is_refused(make_engine: EngineFactory) -> None:
    engine = make_engine(max_running_requests=2)
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match=rf"sampling_params.logit_bias: token {vocab} outside the vocabulary"):
        engine.generate(input_ids=[5, 6], sampling_params=greedy(1, logit_bias={str(vocab): 1}))
