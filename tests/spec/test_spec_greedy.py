"""Greedy speculative decoding equals greedy decoding: tokens, finish reasons, logprobs and returned routes, in exact
mode (bitwise), over batches with mixed acceptance, chunked prefill, prefix-cache hits and preemption.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_spec_greedy.py

The checkpoint's draft agrees with the target often but not always (tests/spec/mtp_checkpoint.py), so verify forwards
accept 0..d drafts; every test asserts it saw both accepted and rejected drafts. Exact mode makes the target's logits
and routes at a position independent of its batch and of how many positions one forward computes, so a verify of
d + 1 tokens must give what d + 1 decode steps give: any difference is a speculation bug (acceptance, KV of rejected
positions, positions or draft rows fed to the target, routes of rejected rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import r3trace
from bench.tiny_models import direct_forward, load_engine_model
from r3trace.engine import Engine
from tests.engine.conftest import EngineFactory
from tests.spec.conftest import VOCAB

ASK: dict[str, Any] = dict(return_routed_experts=True, return_logprob=True, top_logprobs_num=2)


def prompts(seed: int) -> list[list[int]]:
    """6 prompts of 3..40 tokens (no EOS); the last two share their first 24 tokens with the first."""
    rng = np.random.default_rng(seed)
    out = [rng.integers(2, VOCAB, size=n).tolist() for n in (40, 3, 17, 9)]
    return out + [out[0][:24] + rng.integers(2, VOCAB, size=n).tolist() for n in (5, 11)]


def params(stop_token: int | None = None) -> list[dict[str, Any]]:
    """Different lengths (a request of 1 or 2 tokens never drafts d), EOS live on two, a stop token on one."""
    lens = (1, 2, 7, 13, 16, 16)
    out: list[dict[str, Any]] = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": i < 4} for i, n in
                                 enumerate(lens)]
    if stop_token is not None:
        out[3].update(stop_token_ids=[stop_token], ignore_eos=False)  # SGLang: ignore_eos skips stop ids too
    return out


def exact_direct_routes(ckpt: Path, tokens: list[int]) -> np.ndarray:
    """[len(tokens), L, K] int32 routes of one prefix-free exact-mode forward; -1 on dense layers."""
    model = load_engine_model(ckpt, deterministic=True)
    _, routes = direct_forward(model, tokens)
    out = np.full((len(tokens), model.config.num_hidden_layers, model.config.num_experts_per_tok), -1, np.int32)
    for layer, ids in routes.items():
        out[:, layer] = ids.numpy()
    return out


def engines(make_engine: EngineFactory, ckpt: Path, steps: int, **options: Any) -> tuple[Engine, Engine]:
    """A speculative engine and a plain one of the same options, both exact."""
    spec = make_engine(model=ckpt, deterministic=True, speculative_algorithm="NEXTN", speculative_num_steps=steps,
                       **options)
    return spec, make_engine(model=ckpt, deterministic=True, **options)


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Bitwise: tokens, finish reasons, logprobs (floats compared with ==) and the base64 routes."""
    for g, w in zip(got, want, strict=True):
        gm, wm = g["meta_info"], w["meta_info"]
        assert g["output_ids"] == w["output_ids"]
        assert gm["finish_reason"] == wm["finish_reason"]
        assert gm["output_token_logprobs"] == wm["output_token_logprobs"]
        assert gm["output_top_logprobs"] == wm["output_top_logprobs"]
        assert gm.get("input_token_logprobs") == wm.get("input_token_logprobs")
        assert gm.get("input_top_logprobs") == wm.get("input_top_logprobs")
        assert gm.get("input_token_ids_logprobs") == wm.get("input_token_ids_logprobs")
        assert gm.get("output_token_ids_logprobs") == wm.get("output_token_ids_logprobs")
        assert gm["routed_experts"] == wm["routed_experts"], "routes differ from non-speculative decoding"


def assert_mixed_acceptance(results: list[dict[str, Any]]) -> None:
    correct = sum(r["meta_info"].get("spec_num_correct_drafts", 0) for r in results)
    proposed = sum(r["meta_info"].get("spec_num_proposed_drafts", 0) for r in results)
    assert 0 < correct < proposed, f"{correct} of {proposed} drafts accepted: acceptance is not mixed"


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_greedy_speculation_is_greedy_decoding(make_spec_engine: EngineFactory, mtp_ckpt: Path, steps: int) -> None:
    """Chunks of 16 tokens (the 40-token prompt in 3, mixed with other requests' verifies), prefix hits in the second
    round (the first round's prompts + outputs as new prompts: their KV and routes come from the cache)."""
    first = prompts(seed=steps)
    spec, plain = engines(make_spec_engine, mtp_ckpt, steps, chunked_prefill_size=16)
    stop = plain.generate(input_ids=first[3], sampling_params={"temperature": 0, "max_new_tokens": 13})["output_ids"][5]
    got = spec.generate(input_ids=first, sampling_params=params(stop), **ASK)
    want = plain.generate(input_ids=first, sampling_params=params(stop), **ASK)
    second = [p + r["output_ids"] + [5, 6] for p, r in zip(first, want, strict=True)]
    more = spec.generate(input_ids=second, sampling_params=params(), **ASK)
    more_want = plain.generate(input_ids=second, sampling_params=params(), **ASK)
    assert_same(got + more, want + more_want)
    assert any(r["meta_info"]["finish_reason"]["type"] == "stop" for r in got), "no request stopped mid-verify"
    assert sum(r["meta_info"]["cached_tokens"] for r in more) > 0, "the second round must hit the prefix cache"
    assert_mixed_acceptance(got + more)
    if steps == 3:  # and against a direct forward of the sequence (returned routes cover prompt + output - 1 rows)
        for p, r in zip(first + second, got + more, strict=True):
            seq = p + r["output_ids"]
            want_routes = exact_direct_routes(mtp_ckpt, seq[: len(seq) - 1] if r["output_ids"] else seq)
            assert np.array_equal(r3trace.decode_routed_experts(r["meta_info"]), want_routes)


def test_preemption_under_speculation(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """A pool of 96 slots for 6 requests of up to 56 positions: verifies retract the newest requests (their drafts'
    slots are part of what runs out), which re-prefill prompt + output; tokens, prompt and output logprobs and routes
    stay the plain engine's."""
    spec, plain = engines(make_spec_engine, mtp_ckpt, 3, kv_pool_tokens=96, chunked_prefill_size=32)
    sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    got = spec.generate(input_ids=prompts(seed=7), sampling_params=sp, logprob_start_len=0, **ASK)
    want = plain.generate(input_ids=prompts(seed=7), sampling_params=sp, logprob_start_len=0, **ASK)
    assert all(len(g["meta_info"]["input_token_logprobs"]) == len(p) for g, p in zip(got, prompts(7), strict=True))
    assert spec.scheduler.num_retractions > 0, "the pool must be small enough to force retraction"
    assert spec.recompute_mismatches == 0
    assert_same(got, want)
    assert_mixed_acceptance(got)
    assert spec.flush_cache() and spec.kv_pool.num_free_pages == spec.kv_pool.num_pages, "KV of rejected drafts leaked"


def test_accept_lengths_are_reported(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """SGLang's meta_info fields: verify forwards, drafts proposed and accepted, tokens a verify commits."""
    engine = make_spec_engine(model=mtp_ckpt, speculative_algorithm="EAGLE", speculative_num_steps=2)
    sp = {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True}
    out = engine.generate(input_ids=prompts(seed=1)[0], sampling_params=sp)
    m = out["meta_info"]
    # the first token comes from the prefill, then each verify commits accepted drafts + 1
    assert m["spec_verify_ct"] + m["spec_num_correct_drafts"] == len(out["output_ids"]) - 1
    assert m["spec_accept_length"] == (m["spec_num_correct_drafts"] + m["spec_verify_ct"]) / m["spec_verify_ct"]
    assert m["spec_num_proposed_drafts"] <= 2 * m["spec_verify_ct"]
