"""WorkerGroup on a "fatal" report: a peer that died is named as the cause, even when its exit shows after the report.

Run: .venv/bin/pytest -q tests/engine/test_launch_fatal.py

The members are real processes (spawned, sleeping in place of a rank); the report is put on the group's queue as
the control rank puts it (engine/launch/worker.py run_rank), and the peer is killed only after it: the order in
which a killed rank's peer can report a reset connection before the killed process can be reaped.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from r3trace.engine.launch import members as members_module
from r3trace.engine.launch.config import LaunchConfig
from r3trace.engine.launch.group import WorkerGroup
from r3trace.engine.launch.members import Member, ProcessMember

SLEEP_S = 120.0  # a member outlives the test; every one is terminated or killed by the end
KILL_AFTER_S = 0.3  # the peer dies this long after the report: its exit shows after the report was read
RESET = "rank 0 failed: RuntimeError('Connection closed by peer')"


@pytest.fixture
def ranks() -> Iterator[list[Any]]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=time.sleep, args=(SLEEP_S,), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    yield procs
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def _group(procs: list[Any]) -> WorkerGroup:
    members: list[Member] = [ProcessMember(rank, p) for rank, p in enumerate(procs)]
    return WorkerGroup(LaunchConfig(tp_size=2), queue.Queue(), queue.Queue(), members)


def _wait_dead(group: WorkerGroup, limit_s: float) -> str:
    deadline = time.monotonic() + limit_s
    while group.dead is None:
        assert time.monotonic() < deadline, f"no failure named within {limit_s} s"
        time.sleep(0.01)
    return group.dead


def test_fatal_report_names_the_peer_killed_before_its_exit_shows(ranks: list[Any]) -> None:
    group = _group(ranks)
    try:
        answer: list[BaseException] = []

        def in_flight() -> None:  # a call waiting on the ranks when they fail
            try:
                group.call("expert_map")
            except RuntimeError as exc:
                answer.append(exc)

        caller = threading.Thread(target=in_flight, daemon=True)
        caller.start()
        group.from_ranks.put([("fatal", 0, RESET)])
        threading.Timer(KILL_AFTER_S, os.kill, (ranks[1].pid, signal.SIGKILL)).start()
        dead = _wait_dead(group, KILL_AFTER_S + members_module.FATAL_PEER_S + 5)
        assert dead.startswith("rank 1 exited (killed by signal 9)"), dead
        assert RESET in dead  # the reporter's error is kept
        caller.join(5)
        assert answer and "rank 1 exited (killed by signal 9)" in str(answer[0]), answer
        with pytest.raises(RuntimeError, match=r"rank 1 exited \(killed by signal 9\)"):
            group.claim_rid("later")
    finally:
        group.shutdown()


def test_fatal_report_without_a_dead_peer_names_the_reporter(ranks: list[Any],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    wait_s = 0.3  # the bound is read on each report: a short one keeps the test quick
    monkeypatch.setattr(members_module, "FATAL_PEER_S", wait_s)
    group = _group(ranks)
    try:
        t0 = time.monotonic()
        group.from_ranks.put([("fatal", 0, RESET)])
        assert _wait_dead(group, wait_s + 5) == RESET
        assert time.monotonic() - t0 >= wait_s  # it waited for a peer's exit before naming the reporter
    finally:
        group.shutdown()
