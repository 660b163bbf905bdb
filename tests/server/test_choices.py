"""r3trace/server/choices.py without a model: per-choice keywords (seeds, rids, prompt-major order, one batch call)
and the stream merge closing every engine stream when the client goes away.

The engine here is a stand-in (an iterator whose reads block a worker thread for 0.2 s, as an engine step does),
because the property tested is about threads: a stream may be closed only when no worker thread is inside it.

Run: .venv/bin/pytest -q tests/server/test_choices.py
"""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

from r3trace.server.choices import batch_call, choice_requests, choice_seed, merged
from r3trace.server.errors import ApiError
from r3trace.server.metrics import ServerMetrics
from r3trace.server.service import GenerateService


def test_choice_requests_prompt_major_with_seeds_and_rids() -> None:
    kw = {"prompt": ["a", "b"], "input_ids": None, "sampling_params": [{"seed": 7}, {"sampling_seed": 2**63 - 1}],
          "rid": ["x", "y"], "return_logprob": True}
    got = choice_requests(kw, 2)
    assert [(c["prompt"], c["rid"], c["sampling_params"]) for c in got] == [
        ("a", "x.0", {"seed": 7}), ("a", "x.1", {"seed": 8}),
        ("b", "y.0", {"sampling_seed": 2**63 - 1}), ("b", "y.1", {"sampling_seed": 0}),  # wraps in [0, 2**63)
    ]
    assert all(c["return_logprob"] is True and "input_ids" not in c for c in got)
    assert choice_requests({"input_ids": [1, 2], "sampling_params": {"seed": 3}}, 1) == [
        {"input_ids": [1, 2], "sampling_params": {"seed": 3}}]  # n = 1: the request unchanged
    call = batch_call(got)
    assert call["prompt"] == ["a", "a", "b", "b"] and call["rid"] == ["x.0", "x.1", "y.0", "y.1"]
    assert choice_seed(5, 3) == 8
    with pytest.raises(ApiError, match="tag: a list of 3 values for 2 prompts"):
        choice_requests({"prompt": ["a", "b"], "tag": ["t", "u", "v"]}, 2)


class SlowStream:
    """An engine stream whose every read holds a worker thread for `step` s; records whether close() came while a
    read was inside it (a generator would raise "generator already executing" there and run on)."""

    def __init__(self, log: list[str], step: float) -> None:
        self.log, self.step, self.inside, self.k = log, step, threading.Event(), 0

    def __iter__(self) -> SlowStream:
        return self

    def __next__(self) -> dict[str, Any]:
        self.inside.set()
        time.sleep(self.step)
        self.inside.clear()
        self.k += 1
        return {"text": "x", "output_ids": [self.k], "meta_info": {"finish_reason": None}}

    def close(self) -> None:
        self.log.append("closed during a read" if self.inside.is_set() else "closed")


class SlowEngine:
    def __init__(self) -> None:
        self.log: list[str] = []

    def generate(self, step: float, stream: bool = False) -> SlowStream:
        return SlowStream(self.log, step)


def test_leaving_a_merged_stream_closes_every_engine_stream_between_reads() -> None:
    """The client leaves after the first chunk (Starlette cancels the task reading the merge) while the other
    streams' reads are inside the engine (steps of 0.3 and 0.4 s against the first's 0.1 s): every engine stream is
    closed, each between two reads, so its request is aborted now, not when the garbage collector finds it."""
    engine = SlowEngine()
    metrics = ServerMetrics("t")
    service = GenerateService(engine, metrics, max_concurrency=8)

    async def main() -> None:
        streams = await service.open_streams([{"step": 0.1}, {"step": 0.3}, {"step": 0.4}])
        first = anyio.Event()

        async def read() -> None:
            async for _ in merged(streams):
                first.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await first.wait()
            tg.cancel_scope.cancel()  # as Starlette does when the client disconnects

    anyio.run(main)
    assert engine.log == ["closed"] * 3
    assert metrics.in_flight == 0
