"""The speculative scheduler's one-allocation path (VerifySchedule.grow: every running request verifying, all
d + 1 positions of each in one page allocation and one req_to_token write) schedules exactly what the per-request
loop of Scheduler.schedule does: the same requests, positions, draft counts and KV slots every step, over chunked
prefill, page boundaries, a context limit, requests finishing at different steps and retraction. spec.schedule.accept's
one stop check for a verify's tokens (stop_rules.none_can_finish) holds only where no token would stop.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_spec_schedule.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r3trace.engine import Engine
from r3trace.engine.request import Req, SamplingParams
from r3trace.engine.stop_rules import finish_reason, none_can_finish
from tests.engine.conftest import EngineFactory, assert_pool_whole
from tests.spec.test_spec_greedy import prompts

Step = list[tuple[tuple[int, ...], str, int, int, int, list[int]]]


def schedules(engine: Engine, per_request_only: bool, sampling: list[dict[str, Any]]) -> tuple[list[Step], int]:
    """Every step's items (prompt, phase, start, extend_len, draft_len, KV slots) of one generate, and how many steps
    the one-allocation path scheduled. per_request_only: that path always declines (the loop does every step)."""
    sched = engine.scheduler
    steps: list[Step] = []
    fast = [0]
    schedule, grow = sched.schedule, sched.verifies.grow

    def grow_verifies(running: list, budget: int) -> list:
        items = [] if per_request_only else grow(running, budget)
        fast[0] += bool(items)
        return items

    def record() -> list:
        items = schedule()
        steps.append([(tuple(it.req.origin_input_ids), it.phase, it.start, it.extend_len, it.draft_len,
                       it.out_cache_loc.tolist()) for it in items])
        return items

    sched.verifies.grow, sched.schedule = grow_verifies, record  # type: ignore[method-assign]
    engine.generate(input_ids=prompts(seed=5), sampling_params=sampling)
    return steps, fast[0]


@pytest.mark.parametrize("options", [dict(page_size=4, chunked_prefill_size=32),
                                     dict(page_size=4, chunked_prefill_size=16, kv_pool_tokens=64),
                                     dict(page_size=1, max_context_len=48)],
                         ids=["page4", "retract", "context-limit"])
def test_one_allocation_path_schedules_what_the_loop_does(make_spec_engine: EngineFactory, mtp_ckpt: Path,
                                                          options: dict[str, Any]) -> None:
    sampling = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (1, 2, 7, 13, 16, 16)]
    engines = [make_spec_engine(model=mtp_ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3,
                                enable_prefix_cache=False, **options) for _ in range(2)]
    want, none = schedules(engines[0], True, sampling)
    got, fast = schedules(engines[1], False, sampling)
    assert none == 0 and fast >= 5, f"the one-allocation path scheduled {fast} steps"
    assert got == want
    for e in engines:
        assert_pool_whole(e)
    if "kv_pool_tokens" in options:
        assert engines[1].scheduler.num_retractions > 0, "the pool must be small enough to force retraction"


def test_none_can_finish_only_where_no_token_stops() -> None:
    """stop_rules.none_can_finish (spec.schedule.accept's one check for a verify's tokens) is True only where
    finish_reason, called after each token as it is appended, returns None for every one; and it is True often
    enough to matter (most random cases here: room to spare, stop ids outside the tokens)."""
    rng = np.random.default_rng(0)
    eos = frozenset({1})
    agreed = 0
    for case in range(2000):
        params = SamplingParams(max_new_tokens=int(rng.integers(1, 12)), ignore_eos=bool(rng.integers(2)),
                                stop_token_ids=tuple(int(t) for t in rng.integers(0, 40, size=int(rng.integers(3)))),
                                stop=("zz",) if case % 50 == 0 else ())
        req = Req(rid=str(case), origin_input_ids=rng.integers(2, 40, size=int(rng.integers(1, 8))).tolist(),
                  params=params, output_ids=rng.integers(0, 40, size=int(rng.integers(0, 6))).tolist())
        tokens = rng.integers(0, 40, size=int(rng.integers(1, 5))).tolist()
        context = int(rng.integers(5, 24))
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= context:
            continue  # a request that already stopped never verifies
        if not none_can_finish(req, tokens, eos, context):
            continue
        agreed += 1
        for tok in tokens:
            req.output_ids.append(tok)
            assert finish_reason(req, eos, None, context) is None, (case, tokens)  # type: ignore[arg-type]
    assert agreed > 200
