"""Penalties, min_new_tokens and logit_bias under speculation are applied as plain decoding applies them
(engine/spec/penalised.py): greedy speculation returns plain greedy's tokens, logprobs and routes bitwise (exact
mode), and sampled speculation commits tokens distributed as the processed target's p (a chi-square test).

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_spec_penalties.py

Why the per-row counts matter: row j of a verify scores the position after drafts x_1..x_j, so its frequency,
presence and repetition terms count them, and its min_new_tokens ban ends j tokens earlier. Processing every row
with the committed output only (the drafts not counted) makes greedy speculation commit a token plain greedy does not
whenever a draft repeats an earlier token: these tests fail then (mutations named in the report).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.engine.conftest import EngineFactory
from tests.spec.graph_standin import install_spec_graphs
from tests.spec.test_spec_greedy import ASK, assert_mixed_acceptance, assert_same, engines, prompts
from tests.spec.test_spec_sampling import assert_follows


def processed(stop: int) -> list[dict[str, Any]]:
    """One request per option and one with all of them, plus an unprocessed one in the same batches."""
    base = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    return [
        {**base, "frequency_penalty": 0.9},
        {**base, "presence_penalty": 0.7, "repetition_penalty": 1.4},
        {**base, "min_new_tokens": 12, "ignore_eos": False, "stop_token_ids": [stop]},
        {**base, "logit_bias": {str(stop): 2.5, "7": -100.0}},
        {**base, "max_new_tokens": 13},
        {**base, "frequency_penalty": 0.4, "presence_penalty": -0.3, "repetition_penalty": 0.8, "min_new_tokens": 5,
         "logit_bias": {"9": 1.5}, "ignore_eos": False, "stop_token_ids": [stop]},
    ]


def test_greedy_speculation_with_penalties_is_greedy_decoding(make_spec_engine: EngineFactory, mtp_ckpt: Path
                                                              ) -> None:
    """Two rounds, chunks of 16 (prefills mixed with verifies), the second round's prompts extend the first's (prefix
    hits: each request's counts row is rebuilt from its own history on a reused row); d = 3."""
    first = prompts(seed=4)
    spec, plain = engines(make_spec_engine, mtp_ckpt, 3, chunked_prefill_size=16)
    stop = plain.generate(input_ids=first[2], sampling_params={"temperature": 0, "max_new_tokens": 8})["output_ids"][3]
    sp = processed(stop)
    got = spec.generate(input_ids=first, sampling_params=sp, **ASK)
    want = plain.generate(input_ids=first, sampling_params=sp, **ASK)
    second = [p + r["output_ids"] + [5, 6] for p, r in zip(first, want, strict=True)]
    more = spec.generate(input_ids=second, sampling_params=sp, **ASK)
    more_want = plain.generate(input_ids=second, sampling_params=sp, **ASK)
    assert_same(got + more, want + more_want)
    assert_mixed_acceptance(got + more)
    # the options change greedy's tokens here, so the equality above is about them
    raw = plain.generate(input_ids=first, sampling_params=[{"temperature": 0, "max_new_tokens": s["max_new_tokens"],
                                                             "ignore_eos": s["ignore_eos"],
                                                             "stop_token_ids": s.get("stop_token_ids")} for s in sp])
    for i in (0, 1, 2, 3, 5):
        assert raw[i]["output_ids"] != want[i]["output_ids"], f"request {i}: its options changed nothing"
    assert len(raw[2]["output_ids"]) < 12 <= len(want[2]["output_ids"]), "min_new_tokens must have held a stop back"


def test_preemption_with_penalties_under_speculation(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """A pool small enough that verifies retract requests: a re-admitted request rebuilds its counts row from its
    output so far, and its tokens stay plain greedy's."""
    spec, plain = engines(make_spec_engine, mtp_ckpt, 3, kv_pool_tokens=96, chunked_prefill_size=32)
    sp = [{"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "frequency_penalty": 0.6,
           "repetition_penalty": 1.3}] * 6
    got = spec.generate(input_ids=prompts(seed=8), sampling_params=sp, **ASK)
    want = plain.generate(input_ids=prompts(seed=8), sampling_params=sp, **ASK)
    assert spec.scheduler.num_retractions > 0, "the pool must be small enough to force retraction"
    assert_same(got, want)


def test_penalised_greedy_steps_on_graphs_take_the_eager_acceptance(make_spec_engine: EngineFactory, mtp_ckpt: Path
                                                                     ) -> None:
    """On the graphs (CPU stand-in, ladder 1, 2, 4, 8): a greedy step with a penalised request replays the verify graph
    and runs the penalised acceptance eagerly (the one-replay greedy graph reads raw logits); a step without any
    replays the greedy graph. Tokens, logprobs and routes stay the eager plain engine's."""
    opts = dict(deterministic=True, max_context_len=64, chunked_prefill_size=48)
    spec = make_spec_engine(model=mtp_ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3, **opts)
    plain = make_spec_engine(model=mtp_ckpt, **opts)
    graphs = install_spec_graphs(spec, (1, 2, 4, 8))
    kinds: list[str] = []
    for kind, name in (("verify", "verify_forward"), ("greedy", "greedy_step")):
        real = getattr(graphs, name)
        setattr(graphs, name, lambda fb, _real=real, _kind=kind: (kinds.append(_kind), _real(fb))[1])
    base = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    rounds = [[{**base, "frequency_penalty": 0.8, "repetition_penalty": 1.2}, base, {**base, "logit_bias": {"4": 3.0}}],
              [base, base, base]]
    for i, sp in enumerate(rounds):
        ids = prompts(seed=20 + i)[:3]
        assert_same(spec.generate(input_ids=ids, sampling_params=sp, **ASK),
                    plain.generate(input_ids=ids, sampling_params=sp, **ASK))
        assert kinds and set(kinds) == ({"verify"} if i == 0 else {"greedy"}), kinds
        kinds.clear()


def test_sampled_speculation_with_penalties_follows_the_processed_target(make_spec_engine: EngineFactory,
                                                                         tmp_path: Path) -> None:
    """600 requests of one prompt, vocabulary 4, 2 drafts, temperature 0.8, frequency_penalty 1.5 and a logit_bias:
    the joint of output tokens 2 and 3 (committed by the first verify, where token 3's row counts draft 1) against
    p(t1) p(t2 | t1) p(t3 | t1, t2) built here from the plain engine's raw logprobs with the penalty and bias applied by
    hand (only output tokens count)."""
    from tests.spec.mtp_checkpoint import make_mtp_checkpoint

    v, n, prompt, temp, freq, bias = 4, 600, [3, 2, 0, 3, 2], 0.8, 1.5, {1: 0.7}
    ckpt = make_mtp_checkpoint(tmp_path / "v4", seed=5, vocab_size=v, noise=2.0)
    plain = make_spec_engine(model=ckpt)
    grid = [prompt + [a, b] for a in range(v) for b in range(v)]
    outs = plain.generate(input_ids=grid, sampling_params={"temperature": 0, "max_new_tokens": 1},
                          return_logprob=True, logprob_start_len=len(prompt), top_logprobs_num=v)

    def dist(tops: list[tuple[float, int, None]], outputs: list[int]) -> np.ndarray:
        logits = np.zeros(v)
        for lp, tok, _ in tops:
            logits[tok] = lp - freq * outputs.count(tok) + bias.get(tok, 0.0)
        e = np.exp((logits - logits.max()) / temp)
        return e / e.sum()

    want = np.zeros((v, v, v))
    for seq, o in zip(grid, outs, strict=True):
        a, b = seq[-2:]
        m = o["meta_info"]
        want[a, b] = (dist(m["input_top_logprobs"][0], [])[a] * dist(m["input_top_logprobs"][1], [a])[b]
                      * dist(m["output_top_logprobs"][0], [a, b]))
    want = want.sum(axis=0)  # [V, V]

    spec = make_spec_engine(model=ckpt, speculative_algorithm="NEXTN", speculative_num_steps=2, seed=13,
                            max_running_requests=256, chunked_prefill_size=2048, kv_pool_tokens=4096)
    sp = [{"temperature": temp, "max_new_tokens": 4, "ignore_eos": True, "frequency_penalty": freq,
           "logit_bias": {str(k): x for k, x in bias.items()}, **({"seed": i} if i % 2 else {})} for i in range(n)]
    got = spec.generate(input_ids=[prompt] * n, sampling_params=sp)
    assert_follows(got, want)

