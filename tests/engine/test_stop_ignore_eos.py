"""ignore_eos skips the stop token ids too, as SGLang's token rule does.

The contract, read (not copied) from sgl-project/sglang python/sglang/srt/managers/schedule_batch.py at
fd3907ee4618e96b73ee94d9a836db78efb5d046: Req._check_token_based_finish returns False at once when
sampling_params.ignore_eos is set, before it compares the token with stop_token_ids or the EOS ids; stop strings
(_check_str_based_finish) still run. vLLM differs (its stop_token_ids stop under ignore_eos).

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_stop_ignore_eos.py
"""

from __future__ import annotations

from tests.engine.conftest import EOS, EngineFactory, greedy, random_prompts


def test_ignore_eos_runs_past_a_stop_token_id(make_engine: EngineFactory) -> None:
    e = make_engine()
    prompt = random_prompts(1, 6, 6, seed=11)[0]
    full = e.generate(input_ids=prompt, sampling_params=greedy(12))["output_ids"]
    k = next(i for i in range(2, 12) if full.index(full[i]) == i and EOS not in full[: i + 1])
    ignored = e.generate(input_ids=prompt, sampling_params=greedy(12, stop_token_ids=[full[k]]))
    assert ignored["output_ids"] == full  # the stop id came at k and did not stop it
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    honoured = e.generate(input_ids=prompt, sampling_params=greedy(12, stop_token_ids=[full[k]], ignore_eos=False))
    assert honoured["output_ids"] == full[: k + 1]
    assert honoured["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[k]}


def test_ignore_eos_keeps_stop_strings(make_engine: EngineFactory) -> None:
    """A stop string still stops an ignore_eos request (SGLang checks strings after the token rule)."""
    e = make_engine()
    prompt = random_prompts(1, 6, 6, seed=12)[0]
    full = e.generate(input_ids=prompt, sampling_params=greedy(30))["output_ids"]
    j = next(i for i, t in enumerate(full) if 32 <= t < 127)
    out = e.generate(input_ids=prompt, sampling_params=greedy(30, stop=[chr(full[j])]))
    assert out["output_ids"] == full[: j + 1] and out["meta_info"]["finish_reason"]["type"] == "stop"
