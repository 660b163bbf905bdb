"""Output logprobs are SGLang's default: the log-softmax of the logits the token is sampled from.

The contract, read (not copied) from SGLang's layers/sampler.py Sampler.forward (doublewordai/sglang-upstream, a
mirror of sgl-project/sglang, at e8accc05b57a5a9aad2679f2d1c2555bd144ae32): the logits reach the sampler with the
penalties, min_new_tokens and logit_bias already applied (SamplingBatchInfo.apply_logits_bias, in place); greedy
batches return log_softmax(logits); sampled ones divide by the temperature and return log(softmax(...)), before
top-k / top-p / min-p; only SGLANG_RETURN_ORIGINAL_LOGPROB (off by default) returns them before the temperature.
SGLang sets a greedy request's temperature to 1 (sampling_params.py), so a greedy row in a sampled batch scores the
same. Prompt logprobs are the raw model's.

Reference: the raw log-softmax at every output position, all V ids, from a scoring request (token_ids_logprob over
the whole vocabulary), then the penalties recomputed from the output so far. Frequency and presence penalties and
logit_bias are additive and the temperature a scale, so log-softmax of them over raw logprobs equals log-softmax
over raw logits.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_output_logprobs.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.conftest import VOCAB, EngineFactory, random_prompts

NEW = 10


def _raw_rows(e: Any, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[NEW, V] the raw model's logprobs at each output position."""
    e.flush_cache()
    scored = e.generate(input_ids=prompt + out, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                        logprob_start_len=0, token_ids_logprob=list(range(VOCAB)))
    rows = scored["meta_info"]["input_token_ids_logprobs"][len(prompt) : len(prompt) + len(out)]
    return torch.tensor([[lp for lp, _, _ in row] for row in rows], dtype=torch.float64)


@pytest.mark.parametrize("sp", [
    {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"temperature": 0.7, "seed": 5, "frequency_penalty": 1.0, "logit_bias": {"7": 2.5}},
], ids=["greedy", "sampled"])
def test_output_logprobs_are_after_penalties_and_temperature(make_engine: EngineFactory, sp: dict[str, Any]) -> None:
    e = make_engine()
    prompt = random_prompts(1, 8, 8, seed=31)[0]
    got = e.generate(input_ids=prompt, sampling_params={**sp, "max_new_tokens": NEW, "ignore_eos": True},
                     return_logprob=True, top_logprobs_num=4)
    out, meta = got["output_ids"], got["meta_info"]
    raw = _raw_rows(e, prompt, out)  # [NEW, V]
    temp = sp["temperature"] or 1.0
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    moved = 0.0
    for j, tok in enumerate(out):
        z = raw[j] - sp.get("frequency_penalty", 0) * counts - sp.get("presence_penalty", 0) * (counts > 0)
        for t, b in sp.get("logit_bias", {}).items():
            z[int(t)] += b
        want = torch.log_softmax(z / temp, dim=0)
        lp, tid, _ = meta["output_token_logprobs"][j]
        assert tid == tok and lp == pytest.approx(float(want[tok]), abs=2e-4), j
        tops = meta["output_top_logprobs"][j]
        assert [t for _, t, _ in tops] == want.topk(4).indices.tolist()
        assert [v for v, _, _ in tops] == pytest.approx(want.topk(4).values.tolist(), abs=2e-4)
        moved = max(moved, abs(lp - float(raw[j][tok])))
        counts[tok] += 1
    assert moved > 0.02  # 100x the tolerance: the raw logprobs would fail the checks above


def test_prompt_logprobs_stay_raw(make_engine: EngineFactory) -> None:
    """A penalised, heated request's prompt logprobs equal an unpenalised request's: the model's own."""
    e = make_engine()
    prompt = random_prompts(1, 8, 8, seed=32)[0]
    kw = dict(input_ids=prompt, return_logprob=True, logprob_start_len=0)
    a = e.generate(sampling_params={"temperature": 0.5, "seed": 1, "frequency_penalty": 2.0, "max_new_tokens": 2}, **kw)
    e.flush_cache()
    b = e.generate(sampling_params={"temperature": 0, "max_new_tokens": 1}, **kw)
    assert [x[0] for x in a["meta_info"]["input_token_logprobs"]] == \
        pytest.approx([x[0] for x in b["meta_info"]["input_token_logprobs"]], abs=1e-5, nan_ok=True)
