"""EventLoop.call and wait once the scheduler thread has stopped: an error within a poll, never a hang.

Run: .venv/bin/pytest -q tests/engine/test_event_loop_call.py

A real engine (the tiny random DeepSeek-V3 of conftest.py) and its real scheduler thread; each waiting call runs
in a thread joined with a timeout, so a regression fails here instead of hanging the suite.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest

from r3trace.engine.event_loop import _POLL_S, EventLoop
from tests.engine.conftest import EngineFactory

STOPPED = "the engine's scheduler thread has stopped"
LIMIT_S = 2 * _POLL_S + 5  # a stopped thread is noticed within one poll; the rest is slack for a loaded host


def _within_limit(fn: Callable[[], Any]) -> Any:
    """fn() in a thread: its value, or the exception it raised; fails if it has not returned within LIMIT_S."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception as exc:
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(LIMIT_S)
    assert not t.is_alive(), f"still waiting after {LIMIT_S:g} s"
    return box[0]


def _loop(make_engine: EngineFactory) -> EventLoop:
    loop = make_engine()._loop
    assert isinstance(loop, EventLoop)
    return loop


def test_call_returns_the_value_or_raises_the_error(make_engine: EngineFactory) -> None:
    loop = _loop(make_engine)
    assert _within_limit(lambda: loop.call(lambda: 42)) == 42

    def fails() -> None:
        raise KeyError("raised on the scheduler thread")

    with pytest.raises(KeyError, match="raised on the scheduler thread"):
        loop.call(fails)


def test_call_queued_behind_shutdown_raises(make_engine: EngineFactory) -> None:
    loop = _loop(make_engine)
    loop._inbox.put(("shutdown", None))  # the thread ends on it, never reading the call queued after it
    err = _within_limit(lambda: loop.call(lambda: 42))
    assert isinstance(err, RuntimeError) and str(err) == STOPPED, err
    assert not loop._thread.is_alive()
    err = _within_limit(lambda: loop.call(lambda: 42))  # and once the thread is known to be gone
    assert isinstance(err, RuntimeError) and str(err) == STOPPED, err


class _EndsAsAsked:
    """Stands in for the scheduler thread (a mock: the instant between a caller's timed-out get and its liveness
    check cannot be hit on purpose with a real thread). Asked whether it is alive, it first serves what the inbox
    holds (a call's answer, or a result into `sink`), then says it has ended."""

    def __init__(self, loop: EventLoop, sink: queue.Queue[Any] | None = None) -> None:
        self.loop, self.sink = loop, sink

    def is_alive(self) -> bool:
        while not self.loop._inbox.empty():
            self.loop.handle(self.loop._inbox.get_nowait())
        if self.sink is not None:
            self.sink.put({"rid": "r"})
            self.sink = None
        return False


def test_answer_put_as_the_thread_ends_is_returned(make_engine: EngineFactory) -> None:
    loop = _loop(make_engine)
    loop.shutdown()
    real = loop._thread
    try:
        loop._thread = _EndsAsAsked(loop)  # type: ignore[assignment]
        assert _within_limit(lambda: loop.call(lambda: 42)) == 42
        sink: queue.Queue[Any] = queue.Queue()
        loop._thread = _EndsAsAsked(loop, sink)  # type: ignore[assignment]
        assert _within_limit(lambda: loop.wait(sink)) == {"rid": "r"}
    finally:
        loop._thread = real
