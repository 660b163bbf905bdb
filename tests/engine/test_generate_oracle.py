"""Engine.generate against transformers on the same tokens: every logprob the engine returns, through its KV
cache, pages, chunked prefill, prefix-cache hits, preemption and decode steps.

Oracle: transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM run once over each request's whole
sequence (prompt + the ids the engine generated), log_softmax of its logits: row p scores token p + 1. Every
input logprob, output logprob and top-k logprob (value and id) must match it within LOGPROB_ATOL, and every
greedy token must be the oracle's argmax.

Run: .venv/bin/pytest -q tests/engine/test_generate_oracle.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.tiny_models import CONFIGS, load_hf, make_checkpoint
from r3trace.engine import Engine
from tests.engine.conftest import assert_pool_whole, random_prompts
from tests.kernels.conftest import DEVICE, requires_triton

# fp32 end to end on both sides; only the order of reductions differs (absorbed MLA over the cache against
# transformers' normal form, chunks against one pass, paged gathers). Measured worst case over these tests and
# the five tiny configs: 1.9e-6 (torch 2.13 CPU). Logprobs here are ~ -6 (vocabulary 320): 1e-4 is 50x the
# measured error, while a token read at the wrong position, a row of another request, or a missing
# log_softmax moves a logprob by > 1e-2.
LOGPROB_ATOL = 1e-4
TOP = 5  # top_logprobs_num
NEW = 8  # max_new_tokens


def _sampled(seed: int) -> dict[str, Any]:
    return {"temperature": 1.0, "max_new_tokens": NEW, "ignore_eos": True, "seed": seed}


def _greedy() -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(checkpoint, transformers model) of each tiny config: three V3, two V2."""
    ckpt = make_checkpoint(tmp_path_factory.mktemp("oracle") / request.param, request.param, seed=13)
    return ckpt, load_hf(ckpt)


def _oracle(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over the whole sequence: [len(ids), V] fp32."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check_top(got: list[tuple[float, int, None]], row: torch.Tensor, where: str) -> None:
    """The engine's top-k entries of one row against the oracle row: the k largest values in order, each id's
    oracle logprob equal to its value, and the ids in the oracle's order wherever the oracle's neighbours are
    more than twice the tolerance apart (closer ones may swap)."""
    k = len(got)
    ref = row.topk(k)
    values, ids = [v for v, _, _ in got], [i for _, i, _ in got]
    assert max(abs(a - b) for a, b in zip(values, ref.values.tolist(), strict=True)) < LOGPROB_ATOL, where
    assert max(abs(v - row[i].item()) for v, i in zip(values, ids, strict=True)) < LOGPROB_ATOL, where
    gaps = (-row.topk(k + 1).values.diff()).tolist()  # [k] gap below each of the top k
    for j in range(k):
        separated = gaps[j] > 2 * LOGPROB_ATOL and (j == 0 or gaps[j - 1] > 2 * LOGPROB_ATOL)
        if separated:
            assert ids[j] == ref.indices[j].item(), f"{where}: rank {j} id {ids[j]} != {ref.indices[j].item()}"


def check_against_oracle(hf: torch.nn.Module, prompt: list[int], params: dict[str, Any], out: dict[str, Any],
                         start: int) -> int:
    """Every logprob of one result against the oracle; returns how many values were compared."""
    meta, outs = out["meta_info"], out["output_ids"]
    assert len(outs) == NEW and meta["prompt_tokens"] == len(prompt)
    ref = _oracle(hf, prompt + outs)  # [T, V]
    n = 0
    inputs, input_tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [t for _, t, _ in inputs] == prompt[start:] and len(input_tops) == len(inputs)
    for j, ((lp, tok, _), top) in enumerate(zip(inputs, input_tops, strict=True)):
        pos = start + j
        if pos == 0:
            assert lp is None and top is None  # nothing predicts the first token
            continue
        assert abs(lp - ref[pos - 1, tok].item()) < LOGPROB_ATOL, f"input position {pos}"
        _check_top(top, ref[pos - 1], f"input top at position {pos}")
        n += 1 + TOP
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == NEW
    for i, ((lp, tok, _), top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                                                strict=True)):
        row = len(prompt) - 1 + i  # the row that sampled output i
        assert tok == outs[i] and abs(lp - ref[row, tok].item()) < LOGPROB_ATOL, f"output {i}"
        _check_top(top, ref[row], f"output top {i}")
        if params["temperature"] == 0:
            assert tok == int(ref[row].argmax()), f"greedy output {i} is not the oracle's argmax"
        n += 1 + TOP
    return n


def run_prefix_hit(ckpt: Path, hf: torch.nn.Module, **engine_options: Any) -> None:
    """5-token chunks over 4-slot pages. A first request caches a 13-token prefix; then a batch where one request
    shares it (12 tokens, 3 whole pages, come from the cache: its logprobs start at position 13, so the match is
    not capped) beside an unrelated one scored from position 0."""
    shared = random_prompts(1, 13, 13, seed=21)[0]
    tail_a, tail_b, other = random_prompts(3, 5, 17, seed=22)
    first, second = shared + tail_a[:5], shared + tail_b[:6]  # 18 and 19 tokens
    with Engine(ckpt, chunked_prefill_size=5, page_size=4, **engine_options) as e:
        out = e.generate(input_ids=first, sampling_params=_greedy(), return_logprob=True, logprob_start_len=0,
                         top_logprobs_num=TOP)
        assert out["meta_info"]["cached_tokens"] == 0
        n = check_against_oracle(hf, first, _greedy(), out, 0)
        params = [_sampled(1), _greedy()]
        outs = e.generate(input_ids=[second, other], sampling_params=params, return_logprob=True,
                          logprob_start_len=[13, 0], top_logprobs_num=TOP)
        assert isinstance(outs, list)
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [12, 0]
        n += check_against_oracle(hf, second, params[0], outs[0], 13)
        n += check_against_oracle(hf, other, params[1], outs[1], 0)
        assert_pool_whole(e)
    assert n == (17 + 6 + len(other) - 1 + 3 * NEW) * (1 + TOP)


def run_preemption(ckpt: Path, hf: torch.nn.Module, **engine_options: Any) -> None:
    """A 48-slot pool (2-slot pages) cannot hold 4 requests of 14-18 prompt + 8 new tokens: the newest are
    retracted and re-prefilled from prompt + tokens so far, their logprobs continuing where they stopped."""
    prompts = random_prompts(4, 10, 18, seed=23)
    params = [_sampled(2), _greedy(), _sampled(3), _greedy()]
    with Engine(ckpt, kv_pool_tokens=48, page_size=2, chunked_prefill_size=16, **engine_options) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0,
                          top_logprobs_num=TOP)
        assert e.scheduler.num_retractions > 0
        assert isinstance(outs, list)
        for prompt, p, out in zip(prompts, params, outs, strict=True):
            check_against_oracle(hf, prompt, p, out, 0)
        assert_pool_whole(e)


def test_chunked_paged_prefix_hit_and_decode(model: tuple[Path, torch.nn.Module]) -> None:
    run_prefix_hit(*model)


def test_preemption(model: tuple[Path, torch.nn.Module]) -> None:
    run_preemption(*model)


@pytest.mark.slow
@requires_triton
def test_triton_backends(tmp_path: Path) -> None:
    """The same two runs with every backend triton (the CPU interpreter here: ~2.5 min; on a GPU, seconds)."""
    ckpt = make_checkpoint(tmp_path / "v3", "v3_noaux_groups", seed=13)
    hf = load_hf(ckpt)
    backends: dict[str, Any] = {f"{op}_backend": "triton" for op in ("attention", "moe", "topk", "norm", "rope")}
    run_prefix_hit(ckpt, hf, device=DEVICE, **backends)
    run_preemption(ckpt, hf, device=DEVICE, **backends)
