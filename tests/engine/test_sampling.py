"""Sampling as distributions and as exact seeded draws.

The Sampler is driven directly with fixed logits: many rows of one batched call are many independent draws,
and a chi-square goodness-of-fit test compares their counts with softmax(logits / T), top-k or top-p
renormalised, all computed here in float64 from the definitions (SGLang's order: temperature, top-k, softmax,
top-p on the result). Then the exact seeded draw of a row, and `sampling_seed` (SGLang's name for the
per-request seed) through Engine.generate in several batch mixes.

Run: .venv/bin/pytest -q tests/engine/test_sampling.py
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from r3trace.engine import InvalidRequestError
from r3trace.engine.request import SamplingParams
from r3trace.engine.sampling import Sampler
from tests.engine.conftest import EngineFactory, greedy, random_prompts

LOGITS = [1.5 - i / 3 for i in range(10)]  # 1.5 .. -1.5: at T = 0.5 the least likely token still has p = 1.2e-3
DRAWS = 100_000  # per case: every expected count >= 100, so the chi-square approximation holds
# p-value below which a fit is rejected: a correct sampler fails one case in a million runs (of other seeds)
P_REJECT = 1e-6
# name -> (temperature, top_k, top_p)
CASES: dict[str, tuple[float, int, float]] = {
    "T0.5": (0.5, -1, 1.0),
    "T1.6": (1.6, -1, 1.0),
    "T0.8-topk4": (0.8, 4, 1.0),
    "T1.2-topp0.7": (1.2, -1, 0.7),
    "T0.9-topk6-topp0.8": (0.9, 6, 0.8),
}


def expected_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The distribution a sampler must draw from, in float64: softmax(logits / T) over the top_k largest
    logits, then the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    scaled = [x / temperature for x in logits]
    kept = sorted(range(len(logits)), key=lambda i: -scaled[i])[: top_k if top_k > 0 else len(logits)]
    z = sum(math.exp(scaled[i]) for i in kept)
    p = {i: math.exp(scaled[i]) / z for i in kept}
    nucleus, mass = [], 0.0
    for i in sorted(p, key=lambda i: -p[i]):
        if mass >= top_p:
            break
        assert abs(mass - top_p) > 1e-3, "a cumulative mass this close to top_p would depend on rounding"
        nucleus.append(i)
        mass += p[i]
    return [p[i] / mass if i in nucleus else 0.0 for i in range(len(logits))]


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """p-value of Pearson's chi-square goodness of fit over the tokens of non-zero probability."""
    n = sum(counts)
    cells = [(c, n * q) for c, q in zip(counts, probs, strict=True) if q > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    dof = len(cells) - 1
    # chi-square survival function = the regularised upper incomplete gamma Q(dof / 2, stat / 2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def sampled_counts() -> dict[str, list[int]]:
    """One batched call of len(CASES) * DRAWS rows, each case's rows with its own parameters, unseeded (the
    sampler's shared generator, seeded): token counts per case."""
    sampler = Sampler("cpu", seed=20)
    logits = torch.tensor(LOGITS).expand(len(CASES) * DRAWS, -1).contiguous()  # [B, V]
    params = [q for t, k, p in CASES.values() for q in [SamplingParams(temperature=t, top_k=k, top_p=p)] * DRAWS]
    tokens = sampler.sample(logits, params, [None] * len(params))  # [B]
    per_case = tokens.view(len(CASES), DRAWS)
    return {name: torch.bincount(row, minlength=len(LOGITS)).tolist()
            for name, row in zip(CASES, per_case, strict=True)}


@pytest.mark.parametrize("name", list(CASES))
def test_samples_fit_the_tempered_truncated_softmax(sampled_counts: dict[str, list[int]], name: str) -> None:
    temperature, top_k, top_p = CASES[name]
    probs = expected_probs(LOGITS, temperature, top_k, top_p)
    counts = sampled_counts[name]
    assert [c for c, q in zip(counts, probs, strict=True) if q == 0] == [0] * probs.count(0.0), (
        f"{name}: a token outside top-k / top-p was drawn: {counts}")
    assert min(DRAWS * q for q in probs if q > 0) >= 100
    p_value = chi_square_p(counts, probs)
    expected = [round(DRAWS * q) for q in probs]
    assert p_value > P_REJECT, f"{name}: counts {counts} vs expected {expected}, p={p_value:.2e}"
    # the draws are enough to tell this distribution from the one without the temperature (T = 1)
    if temperature != 1.0:
        untempered = expected_probs(LOGITS, 1.0, top_k, top_p)
        if all(q > 0 for q, e in zip(untempered, probs, strict=True) if e > 0):
            assert chi_square_p(counts, untempered) < P_REJECT


def test_a_seeded_row_draws_its_own_exponentials_in_any_batch() -> None:
    """Sampling is an exponential race: token = argmax(probs / q), q ~ Exp(1) drawn V at a time from the request's
    generator. So a row seeded s samples, at its k-th step, argmax(probs / q_k) with q_k the k-th V-vector of
    torch.Generator().manual_seed(s), wherever it sits in the batch and whatever the other rows are."""
    v, temperature = len(LOGITS), 0.7
    probs = torch.softmax(torch.tensor(LOGITS) / temperature, dim=-1)  # [V]
    sampler = Sampler("cpu", seed=0)
    seeded = {11: sampler.request_generator(11), 12: sampler.request_generator(12)}
    reference = {s: torch.Generator().manual_seed(s) for s in seeded}
    got: dict[int, list[int]] = {11: [], 12: []}
    expected: dict[int, list[int]] = {11: [], 12: []}
    for step in range(30):
        # rows: the two seeded ones among 0-3 unseeded (greedy or sampled) rows, at positions that move each step
        rows: list[tuple[int | None, SamplingParams]] = [(None, SamplingParams(temperature=1.3))] * (step % 4)
        rows.insert(step % (len(rows) + 1), (11, SamplingParams(temperature=temperature)))
        rows.insert((3 * step) % (len(rows) + 1), (12, SamplingParams(temperature=temperature)))
        if step % 5 == 0:
            rows.append((None, SamplingParams(temperature=0)))
        out = sampler.sample(torch.tensor(LOGITS).expand(len(rows), -1).contiguous(), [p for _, p in rows],
                             [None if s is None else seeded[s] for s, _ in rows])
        for i, (s, _) in enumerate(rows):
            if s is not None:
                got[s].append(int(out[i]))
                expected[s].append(int((probs / torch.empty(v).exponential_(generator=reference[s])).argmax()))
    assert got == expected
    assert got[11] != got[12] and len(set(got[11])) > 3  # different seeds, different draws; not a constant


SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "max_new_tokens": 12, "ignore_eos": True}


def _ids(out: Any) -> list[list[int]]:
    return [r["output_ids"] for r in out]


def test_sampling_seed_reproduces_a_sample_in_any_batch_mix(make_engine: EngineFactory) -> None:
    """sampling_seed is SGLang's name for seed: the same generator, so the same tokens alone, beside seeded and
    unseeded requests, at other batch positions, in chunked and paged engines."""
    prompts = random_prompts(4, 4, 20, seed=9)
    target, prompt = {**SAMPLED, "sampling_seed": 77}, prompts[0]
    alone = make_engine(enable_prefix_cache=False)
    expected = alone.generate(input_ids=prompt, sampling_params=target)["output_ids"]
    assert alone.generate(input_ids=prompt, sampling_params={**SAMPLED, "seed": 77})["output_ids"] == expected
    assert alone.generate(input_ids=prompt, sampling_params={**target, "seed": 77})["output_ids"] == expected
    other_seed = alone.generate(input_ids=prompt, sampling_params={**SAMPLED, "sampling_seed": 78})["output_ids"]
    greedy_ids = alone.generate(input_ids=prompt, sampling_params=greedy(12))["output_ids"]
    assert expected not in (other_seed, greedy_ids)

    unseeded, seeded = dict(SAMPLED), {**SAMPLED, "seed": 5}
    e = make_engine(chunked_prefill_size=5, page_size=2)
    mixes = [
        ([prompts[1], prompts[2], prompt, prompts[3]], [unseeded, seeded, target, unseeded], 2),
        ([prompt, prompts[2], prompts[1]], [target, seeded, unseeded], 0),
        ([prompts[3], prompts[1], prompt], [{**SAMPLED, "sampling_seed": 3}, unseeded, target], 2),
    ]
    for batch, params, at in mixes:
        assert _ids(e.generate(input_ids=batch, sampling_params=params))[at] == expected


def test_seed_and_sampling_seed_must_agree(make_engine: EngineFactory) -> None:
    e = make_engine()
    with pytest.raises(InvalidRequestError, match="sampling_seed: 2 differs from seed=1") as info:
        e.generate(input_ids=[5, 6, 7], sampling_params={"seed": 1, "sampling_seed": 2})
    assert info.value.field == "sampling_params.sampling_seed"
    with pytest.raises(InvalidRequestError, match="sampling_seed: -3 must be null or an integer") as info:
        e.generate(input_ids=[5, 6, 7], sampling_params={"sampling_seed": -3})
    assert info.value.field == "sampling_params.sampling_seed"
    out = e.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=[{"seed": 1, "sampling_seed": 2}, greedy(2)])
    assert isinstance(out, list) and "sampling_seed" in out[0]["error"] and len(out[1]["output_ids"]) == 2
