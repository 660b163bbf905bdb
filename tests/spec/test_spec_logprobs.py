"""Output logprobs under speculation are scored as without it (SGLang's default, tests/engine/test_output_logprobs.py):
the log-softmax of the target's logits over the request's temperature, at the row the committed token was sampled
from. Requests here set no penalty, logit_bias or min_new_tokens (tests/spec/test_spec_penalties.py covers those), so
the temperature is the only step.

Reference: the raw log-softmax at every output position, all V ids, from a scoring request on a plain engine
(token_ids_logprob over the whole vocabulary), divided by the temperature.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_spec_logprobs.py
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.conftest import EngineFactory
from tests.spec.conftest import VOCAB

NEW = 12


def test_sampled_logprobs_under_speculation_are_over_the_temperature(make_spec_engine: EngineFactory) -> None:
    spec = make_spec_engine(speculative_algorithm="NEXTN", speculative_num_steps=2)
    plain = make_spec_engine()
    rng = random.Random(41)
    prompt = [rng.randrange(2, VOCAB) for _ in range(8)]  # no EOS (id 1)
    temp = 0.6
    got = spec.generate(input_ids=prompt, sampling_params={"temperature": temp, "seed": 3, "max_new_tokens": NEW,
                                                           "ignore_eos": True},
                        return_logprob=True, top_logprobs_num=3)
    out, meta = got["output_ids"], got["meta_info"]
    assert len(out) == NEW
    scored = plain.generate(input_ids=prompt + out, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                            logprob_start_len=0, token_ids_logprob=list(range(VOCAB)))
    rows = scored["meta_info"]["input_token_ids_logprobs"][len(prompt) : len(prompt) + NEW]
    raw = torch.tensor([[lp for lp, _, _ in row] for row in rows], dtype=torch.float64)  # [NEW, V]
    moved = 0.0
    for j, tok in enumerate(out):
        want = torch.log_softmax(raw[j] / temp, dim=0)
        lp, tid, _ = meta["output_token_logprobs"][j]
        assert tid == tok and lp == pytest.approx(float(want[tok]), abs=2e-4), j
        tops = meta["output_top_logprobs"][j]
        assert [t for _, t, _ in tops] == want.topk(3).indices.tolist()
        moved = max(moved, abs(lp - float(raw[j][tok])))
    assert moved > 0.02  # 100x the tolerance: the raw logprobs fail the checks above
