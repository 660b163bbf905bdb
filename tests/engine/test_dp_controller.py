"""DpController and LaunchConfig: which DP rank runs each request; the launch sizes checked before any spawn.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_dp_controller.py
"""

from __future__ import annotations

import random

import pytest

from r3trace.engine.engine_config import EngineConfigError
from r3trace.engine.launch.config import LaunchConfig
from r3trace.engine.launch.controller import DpController, check_routed_dp_rank
from r3trace.engine.request import InvalidRequestError


def test_round_robin_cycles_and_pins_take_no_turn() -> None:
    c = DpController(3)
    assert [c.assign() for _ in range(4)] == [0, 1, 2, 0]
    assert c.assign(2) == 2 and c.assign(2) == 2  # pinned: the cycle stays where it was
    assert [c.assign() for _ in range(3)] == [1, 2, 0]
    assert c.in_flight == [3, 2, 4]


def test_shortest_queue_picks_the_fewest_in_flight_lowest_rank_on_ties() -> None:
    c = DpController(3, "shortest_queue")
    assert [c.assign() for _ in range(3)] == [0, 1, 2]
    c.finished(1)
    assert c.assign() == 1
    c.finished(0)
    c.finished(2)
    assert c.in_flight == [0, 1, 0] and c.assign() == 0 and c.assign() == 2
    assert c.assign(1) == 1 and c.in_flight == [1, 2, 1]  # a pin overrides the shortest queue


def test_shortest_queue_balances_a_seeded_random_load() -> None:
    """Against a brute-force model: each assignment goes to a rank whose queue is minimal at that moment."""
    rng = random.Random(7)
    c = DpController(4, "shortest_queue")
    queues: list[list[int]] = [[] for _ in range(4)]
    for step in range(200):
        if rng.random() < 0.4 and any(queues):
            r = rng.choice([i for i, q in enumerate(queues) if q])
            queues[r].pop()
            c.finished(r)
        else:
            lens = [len(q) for q in queues]
            r = c.assign()
            assert lens[r] == min(lens) and r == lens.index(min(lens)), (step, lens, r)
            queues[r].append(step)
    assert c.in_flight == [len(q) for q in queues]


@pytest.mark.parametrize("bad", [-1, 2, 7, True, "1", 1.0])
def test_bad_routed_dp_rank_names_the_field(bad: object) -> None:
    with pytest.raises(InvalidRequestError) as err:
        check_routed_dp_rank(bad, 2)
    assert err.value.field == "routed_dp_rank" and "outside 0..1 (dp_size=2)" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(InvalidRequestError):
        DpController(2).assign(bad)  # type: ignore[arg-type]


def test_good_routed_dp_rank() -> None:
    assert check_routed_dp_rank(None, 2) is None and check_routed_dp_rank(1, 2) == 1


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(tp_size=0), "tp_size"), (dict(tp_size=4, dp_size=3), "dp_size"), (dict(tp_size=2, ep_size=4), "ep_size"),
    (dict(load_balance_method="random"), "load_balance_method"), (dict(collective_timeout_s=0), "collective_timeout_s"),
])
def test_launch_config_rejects_with_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(EngineConfigError, match=f"^{field}="):
        LaunchConfig(**kwargs)


def test_reporting_ranks_are_attention_tp_rank_zero() -> None:
    assert LaunchConfig(tp_size=4, dp_size=2).reporting_ranks() == [0, 2]
    assert LaunchConfig(tp_size=4).reporting_ranks() == [0]
    assert LaunchConfig(tp_size=4, dp_size=4).reporting_ranks() == [0, 1, 2, 3]
    assert LaunchConfig(tp_size=4, dp_size=2, ep_size=4).manifest() == {"tp_size": 4, "dp_size": 2, "ep_size": 4}


def test_engine_checks_routed_dp_rank_per_request(make_engine: object) -> None:
    """One process is dp_size 1: rank 0 (or none) runs; another fails that request only, naming the field."""
    engine = make_engine()  # type: ignore[operator]
    params = {"max_new_tokens": 2, "temperature": 0}
    assert engine.generate(input_ids=[5, 6, 7], sampling_params=params, routed_dp_rank=0)["output_ids"]
    with pytest.raises(InvalidRequestError, match=r"^routed_dp_rank: 1 outside 0..0 \(dp_size=1\)$"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=params, routed_dp_rank=1)
    ok, bad = engine.generate(input_ids=[[5, 6], [7, 8]], sampling_params=params, routed_dp_rank=[None, 3])
    assert "error" not in ok and bad["error"].startswith("routed_dp_rank: 3 outside")
    outs = engine.generate(input_ids=[[5, 6], [7, 8]], sampling_params=params, routed_dp_rank=[0])
    assert [o["error"] for o in outs] == ["routed_dp_rank: a list of 1 values for 2 request(s)"] * 2
