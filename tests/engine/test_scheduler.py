"""Scheduling never changes greedy tokens: batch composition, arrival order, chunk sizes, prefix-cache
hits (a prefix ending inside a partly filled page) and preemption all give the tokens that each
request gets when it runs alone. Abort frees every KV slot.

Run: .venv/bin/pytest -q tests/engine/test_scheduler.py
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from r3trace.engine import Engine
from tests.engine.conftest import EngineFactory, assert_pool_whole, greedy, random_prompts

NEW = 10
PROMPTS = random_prompts(5, 3, 30, seed=1)


def _alone(make_engine: EngineFactory, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    """The reference: one request at a time, no prefix cache, one chunk per prompt."""
    e = make_engine(enable_prefix_cache=False)
    return [e.generate(input_ids=p, sampling_params=greedy(new))["output_ids"] for p in prompts]


def _together(e: Engine, prompts: list[list[int]], new: int = NEW) -> list[list[int]]:
    out = e.generate(input_ids=prompts, sampling_params=greedy(new))
    assert isinstance(out, list)
    return [r["output_ids"] for r in out]


@pytest.fixture(scope="module")
def reference(tiny_ckpt: Any) -> list[list[int]]:
    with Engine(tiny_ckpt, enable_prefix_cache=False) as e:
        return [e.generate(input_ids=p, sampling_params=greedy(NEW))["output_ids"] for p in PROMPTS]


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(chunked_prefill_size=3),
        dict(chunked_prefill_size=7, page_size=4),
        dict(chunked_prefill_size=7, max_running_requests=2),
        dict(page_size=4, enable_prefix_cache=False),
    ],
    ids=["default", "chunk3", "chunk7-page4", "max-running2", "page4-nocache"],
)
def test_batched_equals_alone(make_engine: EngineFactory, reference: list[list[int]], options: dict) -> None:
    e = make_engine(**options)
    assert _together(e, PROMPTS) == reference
    assert _together(e, PROMPTS[::-1]) == reference[::-1]  # arrival order; the cache is warm now
    assert_pool_whole(e)


def test_arrivals_while_others_decode(make_engine: EngineFactory, reference: list[list[int]]) -> None:
    """Requests from several threads (odd ones streaming) join a batch that is already decoding."""
    e = make_engine(chunked_prefill_size=7, page_size=2)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        time.sleep(0.01 * i)
        if i % 2:
            chunks = e.generate(input_ids=PROMPTS[i], sampling_params=greedy(NEW), stream=True)
            results[i] = [t for c in chunks for t in c["output_ids"]]  # type: ignore[index]
        else:
            results[i] = e.generate(input_ids=PROMPTS[i], sampling_params=greedy(NEW))["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(PROMPTS))] == reference
    assert_pool_whole(e)


@pytest.mark.parametrize("chunk", [3, 7, 512])
def test_prefix_hits_with_partial_pages(make_engine: EngineFactory, chunk: int) -> None:
    """page_size 4: a 10-token shared prefix is 2 whole pages + 2 tokens of a partly filled page;
    only the 8 whole-page tokens are shared, the other 2 are recomputed."""
    shared = random_prompts(1, 10, 10, seed=5)[0]
    prompts = [shared + [7, 8, 9], shared + [11, 12], shared, shared[:9] + [13]]
    expected = _alone(make_engine, prompts)
    e = make_engine(page_size=4, chunked_prefill_size=chunk)
    first = e.generate(input_ids=prompts[0], sampling_params=greedy(NEW))
    assert first["meta_info"]["cached_tokens"] == 0 and first["output_ids"] == expected[0]
    rest = e.generate(input_ids=prompts[1:], sampling_params=greedy(NEW))
    assert isinstance(rest, list)
    assert [r["output_ids"] for r in rest] == expected[1:]
    # the first request cached prompt + generated tokens whose KV was computed, in whole pages
    assert [r["meta_info"]["cached_tokens"] for r in rest] == [8, 8, 8]
    again = e.generate(input_ids=prompts[0], sampling_params=greedy(NEW))
    assert again["output_ids"] == expected[0] and again["meta_info"]["cached_tokens"] == 12
    assert_pool_whole(e)


@pytest.mark.parametrize("page_size", [1, 4])
def test_preemption_keeps_greedy_output(make_engine: EngineFactory, page_size: int) -> None:
    """A 64-slot pool cannot hold 5 requests of up to 30 + 16 tokens: the newest are retracted and
    re-prefilled from prompt + tokens so far."""
    new = 16
    expected = _alone(make_engine, PROMPTS, new)
    e = make_engine(kv_pool_tokens=64, page_size=page_size, chunked_prefill_size=16)
    assert _together(e, PROMPTS, new) == expected
    assert e.scheduler.num_retractions > 0
    assert_pool_whole(e)


def test_abort_mid_generation_frees_every_slot(make_engine: EngineFactory) -> None:
    e = make_engine(page_size=4, chunked_prefill_size=8)
    stream = e.generate(input_ids=PROMPTS[0], sampling_params=greedy(1000), stream=True, rid="victim")
    others: dict[str, Any] = {}

    def run_others() -> None:
        others["out"] = e.generate(input_ids=PROMPTS[1:3], sampling_params=greedy(40))

    t = threading.Thread(target=run_others)
    t.start()
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            e.abort("victim")
    t.join()
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort" and final["completion_tokens"] < 1000
    assert [r["meta_info"]["finish_reason"]["type"] for r in others["out"]] == ["length", "length"]
    # abort of a waiting request, and of an unknown id, are harmless
    e.abort("no-such-request")
    assert_pool_whole(e)


def test_stream_closed_early_aborts(make_engine: EngineFactory) -> None:
    e = make_engine()
    stream = e.generate(input_ids=PROMPTS[0], sampling_params=greedy(1000), stream=True)
    next(iter(stream))
    stream.close()  # type: ignore[union-attr]
    assert e.generate(input_ids=PROMPTS[1], sampling_params=greedy(3))["meta_info"]["completion_tokens"] == 3
    assert_pool_whole(e)  # the inbox is FIFO: the abort was handled before the request above
