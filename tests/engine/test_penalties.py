"""SGLang's penalties, min_new_tokens and min_p: the math against a float64 reference, then end to end.

The contract, read (not copied) from sgl-project/sglang:
- python/sglang/srt/sampling/sampling_params.py at 00c17cafcb9e289d5ca97c50e44ada54e4fd5b03 (verify(): min_p in
  [0, 1], frequency/presence in [-2, 2], repetition in (0, 2], min_new_tokens in [0, max_new_tokens]);
- python/sglang/srt/sampling/penaltylib/frequency_penalty.py and min_new_tokens.py at
  0eaa70667ecaf8c8974101f8dc39aaefab0b0e0b, presence_penalty.py at 0a39d72aa8f04acbf3f97ba67d8b6b67c88903e7,
  repetition_penalty.py at 00731f0bc9fa81c39802754fb4b62e9cce967582: only output tokens are cumulated; frequency
  subtracts penalty * count, presence subtracts the penalty once a token was output, min_new_tokens adds -inf on
  stop_token_ids | EOS while fewer tokens were output; repetition is multiplicative (scales logits < 0 up, the
  others down) and is applied after the additive terms are summed;
- python/sglang/srt/sampling/sampling_batch_info.py at 009db01a7c0d5460611d543516401eb497641918 (apply_logits_bias
  runs before the sampler, so greedy rows are penalised too; min_ps per row) and layers/sampler.py's
  top_k_top_p_min_p_sampling_from_probs_torch: min-p drops probabilities below min_p * the largest.

Run: .venv/bin/pytest -q tests/engine/test_penalties.py
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.tiny_models import direct_forward, load_engine_model, make_checkpoint
from r3trace.engine import Engine, InvalidRequestError
from r3trace.engine.host_staging import HostStaging
from r3trace.engine.penalties import Penalties, PenaltyRow
from r3trace.engine.request import SamplingParams
from r3trace.engine.sampling import Sampler
from tests.engine.conftest import EngineFactory, greedy, random_prompts
from tests.engine.test_sampling import P_REJECT, chi_square_p

SAMPLE_MODEL = Path(__file__).resolve().parents[2] / "samples" / "model"
V, EOS = 40, (3,)
STAGE = HostStaging("cpu").to_device


def reference_logits(logits: list[float], history: list[int], p: SamplingParams, num_out: int) -> list[float]:
    """One row, float64, from the definitions: additive terms, the min_new_tokens ban, then repetition."""
    counts = Counter(history)
    banned = set(p.stop_token_ids) | set(EOS) if num_out < p.min_new_tokens else set()
    out = []
    for t, x in enumerate(logits):
        c = counts[t]
        x = x - p.frequency_penalty * c - (p.presence_penalty if c else 0.0)
        if t in banned:
            x = -math.inf
        if c:
            x = x * p.repetition_penalty if x < 0 else x / p.repetition_penalty
        out.append(x)
    return out


# (params, output history) per row: row 4's min_new_tokens is reached, row 5 has nothing to apply
ROWS: list[tuple[dict[str, Any], list[int]]] = [
    ({"temperature": 0, "repetition_penalty": 1.7}, [4, 9, 9, 30, 4]),
    ({"temperature": 0, "frequency_penalty": 0.8, "presence_penalty": -0.5}, [1, 1, 1, 2, 39]),
    ({"temperature": 0.7, "frequency_penalty": -1.3, "repetition_penalty": 0.6, "seed": 5}, [7, 7, 8, 0]),
    ({"temperature": 1.1, "presence_penalty": 2.0, "repetition_penalty": 2.0, "min_new_tokens": 9,
      "stop_token_ids": (11, 12), "seed": 6}, [11, 20, 21]),
    ({"temperature": 0, "min_new_tokens": 2, "stop_token_ids": (17,)}, [5, 6]),  # reached: nothing banned
    ({"temperature": 0.9, "seed": 7}, [2, 2, 2]),
]


def _rows(history: list[list[int]] | None) -> list[PenaltyRow]:
    out = []
    for b, (kw, hist) in enumerate(ROWS):
        h = hist if history is None else history[b]
        out.append(PenaltyRow(SamplingParams(max_new_tokens=20, **kw), row=2 * b + 1, num_out=len(h),
                              history=h if history is None else None))
    return out


def test_penalised_logits_and_tokens_equal_the_reference() -> None:
    """Two steps on a seeded random batch: the first rebuilds each row's counts from its history, the second
    counts the tokens the first sampled on the device (no history given). Each step's penalised logits equal the
    float64 reference; greedy rows take its argmax, seeded rows draw from softmax(reference / T) with their own
    exponentials. Every counts row starts stale (an earlier owner's): the rebuild overwrites those of the rows with a
    penalty; the rows without one (4, 5) keep stale counts, which their neutral coefficients ignore."""
    torch.manual_seed(0)
    logits = torch.randn(2, len(ROWS), V) * 3  # [steps, B, V]
    pen = Penalties(num_rows=16, vocab=V, eos_token_ids=EOS, device="cpu")
    sampler = Sampler("cpu", seed=1)
    pen.counts = torch.full((16, V), 5.0)  # what earlier requests of these rows left behind
    histories = [list(h) for _, h in ROWS]
    rows = _rows(None)
    for step in range(2):
        params = [r.params for r in rows]
        gens = [None if p.seed is None else sampler.request_generator(p.seed + step) for p in params]
        ref_gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed + step) for p in params]
        penalty = pen.step(rows, STAGE)
        assert penalty is not None
        got = penalty.apply(logits[step])
        ref = torch.tensor([reference_logits(logits[step, b].tolist(), histories[b], p, len(histories[b]))
                            for b, p in enumerate(params)], dtype=torch.float64)
        assert torch.equal(torch.isinf(got), torch.isinf(ref))
        assert torch.allclose(got.double().nan_to_num(neginf=0), ref.nan_to_num(neginf=0), atol=1e-5, rtol=0)
        assert torch.isinf(got[3, [3, 11, 12]]).all() and not torch.isinf(got[4]).any()
        ids = sampler.sample(logits[step].clone(), params, gens, penalty).tolist()
        for b, p in enumerate(params):
            if p.is_greedy:
                assert ids[b] == int(ref[b].argmax())
            else:
                probs = torch.softmax(ref[b] / p.temperature, dim=-1)
                assert ref_gens[b] is not None
                q = torch.empty(V).exponential_(generator=ref_gens[b])
                assert ids[b] == int((probs / q.double()).argmax()), b
        for b, t in enumerate(ids):
            histories[b].append(t)
        counted = [b for b, r in enumerate(rows) if r.params.has_penalty]
        assert [int(pen.counts[rows[b].row].sum()) for b in counted] == [len(histories[b]) for b in counted]
        rows = _rows(histories)


def test_no_penalty_no_work() -> None:
    """The batch-level check: without a penalty or a min_new_tokens still ahead, no step, no counts table."""
    pen = Penalties(num_rows=4, vocab=V, eos_token_ids=EOS, device="cpu")
    plain = [PenaltyRow(SamplingParams(min_new_tokens=2), row=0, num_out=2, history=None),
             PenaltyRow(SamplingParams(temperature=0.5), row=1, num_out=0, history=[])]
    assert pen.step(plain, STAGE) is None and pen.counts is None


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_min_p_drops_exactly_the_tokens_below_min_p_times_the_top(temperature: float) -> None:
    """Probabilities p_i / p_max = exp((l_i - l_max) / T): with min_p 0.3 the tokens on either side of the threshold
    are 8% away from it, so each kept token is drawn hundreds of times in 60,000 draws and a dropped one never; the
    counts fit the kept tokens' renormalised probabilities."""
    ratios = [1.0, 0.7, 0.45, 0.33, 0.276, 0.2, 0.05, 0.01]  # of p_max at T = 1
    min_p, draws = 0.3, 60_000
    logits = torch.tensor([temperature * math.log(r) for r in ratios])  # at temperature T the ratios above hold
    params = [SamplingParams(temperature=temperature, min_p=min_p)] * draws
    tokens = Sampler("cpu", seed=3).sample(logits.expand(draws, -1).contiguous(), params, [None] * draws)
    counts = torch.bincount(tokens, minlength=len(ratios)).tolist()
    kept = [r if r >= min_p else 0.0 for r in ratios]
    assert [c > 0 for c in counts] == [k > 0 for k in kept], counts
    assert chi_square_p(counts, [k / sum(kept) for k in kept]) > P_REJECT


def test_min_new_tokens_holds_back_eos_and_stop_tokens(tmp_path: Path, make_engine: EngineFactory) -> None:
    """A checkpoint whose EOS is the greedy first token: it stops after one token; with min_new_tokens 6 the first
    six tokens are never EOS, the first is the most likely token other than EOS (the raw top logprobs rank them),
    and EOS may end the request from the seventh on. stop_token_ids are held back too."""
    prompt = random_prompts(1, 6, 6, seed=4)[0]
    base = make_engine().generate(input_ids=prompt, sampling_params=greedy(1), return_logprob=True,
                                  top_logprobs_num=8)
    ranked = [t for _, t, _ in base["meta_info"]["output_top_logprobs"][0]]  # most likely first
    eos = ranked[0]
    ckpt = make_checkpoint(tmp_path / "eos_first", "v3_noaux_groups", seed=3, eos_token_id=eos)
    with Engine(ckpt) as e:
        plain = e.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 12})
        assert plain["output_ids"] == [eos] and plain["meta_info"]["finish_reason"]["matched"] == eos
        held = e.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                              "min_new_tokens": 6})["output_ids"]
        assert len(held) >= 6 and eos not in held[:6] and held[0] == ranked[1]
        assert eos not in held[:-1]  # the first EOS after the sixth token ends it (or max_new_tokens does)
        both = e.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 3,
                                                              "min_new_tokens": 1, "stop_token_ids": [ranked[1]]})
        assert both["output_ids"][0] == ranked[2]


@pytest.mark.parametrize("overlap", [True, False])
def test_min_new_tokens_boundary_is_exact(make_engine: EngineFactory, overlap: bool) -> None:
    """With the greedy k-th token as a stop token id, min_new_tokens k lets it stop the request at position k, and
    min_new_tokens k + 1 holds it back there: the count includes the token a step ahead has in flight."""
    e = make_engine(overlap_schedule=overlap)
    prompt = random_prompts(1, 6, 6, seed=4)[0]
    full = e.generate(input_ids=prompt, sampling_params=greedy(12))["output_ids"]
    k = next(i for i in range(3, 12) if full.index(full[i]) == i)  # a first occurrence, several steps in
    at_k = e.generate(input_ids=prompt, sampling_params=greedy(12, stop_token_ids=[full[k]], min_new_tokens=k,
                                                               ignore_eos=False))
    assert at_k["output_ids"] == full[: k + 1] and at_k["meta_info"]["finish_reason"]["matched"] == full[k]
    past_k = e.generate(input_ids=prompt, sampling_params=greedy(12, stop_token_ids=[full[k]], ignore_eos=False,
                                                                 min_new_tokens=k + 1))["output_ids"]
    assert past_k[:k] == full[:k] and past_k[k] != full[k]


def test_greedy_repetition_penalty_on_the_sample_model_follows_the_reference() -> None:
    """The bundled sample model at repetition_penalty 2 (SGLang's limit), greedy: every output token is the argmax
    of the reference-penalised logits of a direct forward over the prompt and the outputs before it (margins well
    above rounding), and the repeats the model makes unpenalised mostly go (not all: a logit large enough still
    wins at half its size)."""
    prompts = random_prompts(3, 5, 12, seed=11)
    with Engine(SAMPLE_MODEL) as e:
        plain = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=greedy(48))]
        pen = [o["output_ids"] for o in e.generate(input_ids=prompts,
                                                    sampling_params=greedy(48, repetition_penalty=2.0))]
    model = load_engine_model(SAMPLE_MODEL)
    p = SamplingParams(repetition_penalty=2.0)
    for prompt, out in zip(prompts, pen, strict=True):
        with torch.no_grad():
            logits, _ = direct_forward(model, prompt + out)  # [T, V]
        for t, tok in enumerate(out):
            ref = torch.tensor(reference_logits(logits[len(prompt) - 1 + t].tolist(), out[:t], p, t))
            top2 = ref.topk(2).values
            assert tok == int(ref.argmax()) and float(top2[0] - top2[1]) > 1e-3, (t, tok)
    repeats = [sum(len(o) - len(set(o)) for o in outs) for outs in (plain, pen)]
    assert repeats[0] >= 40 and repeats[1] <= repeats[0] // 4, repeats
    assert [o[0] for o in pen] == [o[0] for o in plain]  # nothing output before the first token


MIXED = [greedy(14, repetition_penalty=1.6), greedy(14, frequency_penalty=0.9, presence_penalty=0.4),
         {"temperature": 0.8, "max_new_tokens": 14, "ignore_eos": True, "seed": 21, "presence_penalty": 1.5,
          "min_p": 0.05},
         greedy(14), greedy(14, frequency_penalty=-0.7, min_new_tokens=3)]


def test_penalties_are_the_same_in_any_batch_under_retraction_and_overlap(make_engine: EngineFactory) -> None:
    """Each request alone equals it in a batch, chunked and paged, without the overlapped scheduler, and under
    KV-pool retraction (its counts rebuilt from its outputs on re-admission)."""
    prompts = random_prompts(len(MIXED), 4, 20, seed=12)
    alone = make_engine(enable_prefix_cache=False)
    expected = [alone.generate(input_ids=p, sampling_params=s)["output_ids"] for p, s in zip(prompts, MIXED,
                                                                                              strict=True)]
    unpenalised = [alone.generate(input_ids=p, sampling_params=greedy(14))["output_ids"] for p in prompts[:2]]
    assert expected[:2] != unpenalised
    for options in ({"chunked_prefill_size": 5, "page_size": 2}, {"overlap_schedule": False},
                    {"kv_pool_tokens": 48, "chunked_prefill_size": 8}):
        e = make_engine(**options)
        got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=MIXED)]
        assert got == expected, options
    assert e.scheduler.num_retractions > 0


@pytest.mark.parametrize(("field", "value", "limit"), [
    ("min_p", 1.5, "must be in [0, 1]"),
    ("min_p", float("nan"), "must be in [0, 1]"),
    ("frequency_penalty", -2.5, "must be in [-2, 2]"),
    ("presence_penalty", 3, "must be in [-2, 2]"),
    ("repetition_penalty", 0, "must be in (0, 2] (1 = no penalty)"),
    ("repetition_penalty", 2.5, "must be in (0, 2] (1 = no penalty)"),
    ("min_new_tokens", 9, "must be an integer in [0, max_new_tokens=8]"),
    ("min_new_tokens", -1, "must be an integer in [0, max_new_tokens=8]"),
    ("skip_special_tokens", "no", "must be true or false"),
    ("no_stop_trim", 1, "must be true or false"),
])
def test_out_of_range_is_one_line_naming_field_and_limit(field: str, value: Any, limit: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"max_new_tokens": 8, field: value})
    assert info.value.field == f"sampling_params.{field}"
    assert str(info.value) == f"sampling_params.{field}: {value!r} {limit}"


def test_null_means_the_default() -> None:
    """As SGLang's SamplingParams.__post_init__: a null value is the field's default."""
    nulls = {name: None for name in ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                                     "min_new_tokens", "temperature", "skip_special_tokens", "no_stop_trim")}
    assert SamplingParams.from_dict(nulls) == SamplingParams()


def test_counts_are_indexed_by_request_row() -> None:
    """Rows of the counts table are the requests' req_to_token rows: a rebuilt row holds its history only."""
    pen = Penalties(num_rows=3, vocab=V, eos_token_ids=EOS, device="cpu")
    row = PenaltyRow(SamplingParams(presence_penalty=1.0), row=2, num_out=3, history=[5, 5, 9])
    step = pen.step([row], STAGE)
    assert step is not None and pen.counts is not None
    expected = np.zeros((3, V), np.float32)
    expected[2, 5], expected[2, 9] = 2, 1
    assert np.array_equal(pen.counts.numpy(), expected)
