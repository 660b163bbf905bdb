"""TraceControl: starts, stops and reports the engine's trace (one at a time), and closes it on every stop.

The TraceWriter lives in the engine's (front end's) process. A TraceTarget connects it to what captures rows:
- LocalTrace (one process): the capturer and the route hooks, reached on the scheduler thread;
- WorkerGroup (several processes, engine/launch/group.py): the ranks attach forwarders between steps, and
  their rows and request summaries come back over the front end's queue to this writer.
Either way the writer is attached between steps, so no forward is half in one run and half in the next. On
stop_trace the capturers drain their copies first (every computed row reaches the writer), and the requests
still running are written as finish_reason "unfinished". On engine shutdown the requests are aborted first
(they finish with finish_reason "abort", rows included), then the trace is closed (writer.py has the
durability contract).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Protocol

from r3trace.capture.capturer import RoutedExpertsCapturer
from r3trace.engine.event_loop import EventLoop
from r3trace.engine.route_capture import RouteCaptureHooks, TeeSink
from r3trace.trace.schema import TraceSchemaError, TraceStateError
from r3trace.trace.stream import TraceStreamWriter
from r3trace.trace.writer import TraceWriter


class TraceTarget(Protocol):
    def trace_attach(self, sink: Any, writer: TraceWriter) -> None:
        """Rows go to sink.append_tokens, finished requests to writer.add_request, from the next step on."""

    def trace_detach(self, after_loop: bool = False) -> None:
        """Drain and detach: every row captured so far has reached the sink when it returns. after_loop: the
        engine's loop (or ranks) has already stopped."""


class PlacementLog(Protocol):
    """What records the expert placement into a trace (placement_control.PlacementControl)."""

    def recording(self, writer: TraceWriter) -> AbstractContextManager[None]:
        """Around the attach: the map in force written first, then each rebalance chunk's switch."""

    def stop_recording(self) -> None:
        """Before the writer closes: no more placement rows go to it."""


class LocalTrace:
    """The one-process target: the capturer's sink and the route hooks' writer, set on the scheduler thread."""

    def __init__(self, loop: EventLoop, capturer: RoutedExpertsCapturer, hooks: RouteCaptureHooks) -> None:
        self.loop = loop
        self.capturer = capturer
        self.hooks = hooks

    def trace_attach(self, sink: Any, writer: TraceWriter) -> None:
        def attach() -> None:
            if self.hooks.writer is not None:
                raise TraceStateError("a trace is already being recorded: stop it first")
            self.capturer.attach_sink(sink)
            self.hooks.writer = writer

        self.loop.call(attach)

    def trace_detach(self, after_loop: bool = False) -> None:
        def detach() -> None:
            self.hooks.writer = None
            self.capturer.detach_sink()

        if after_loop:
            detach()
        else:
            self.loop.call(detach)


class TraceControl:
    def __init__(self, target: TraceTarget, writer_args: dict[str, Any],
                 placements: PlacementLog | None = None) -> None:
        """placements: records the expert placement the engine runs into each trace (None: no placements table)."""
        self.target = target
        self.placements = placements
        self.writer_args = writer_args  # model shape, engine options, hashes: the manifest's fixed fields
        # what start_trace's caller may set: TraceWriter's other keywords (file size, flush interval, fsync, ...)
        fixed = set(writer_args) | {"self", "root", "run_id"}
        self.options = frozenset(inspect.signature(TraceWriter.__init__).parameters) - fixed
        self.writer: TraceWriter | None = None
        self._stream: TraceStreamWriter | None = None
        self._lock = threading.Lock()  # one start or stop at a time

    def start(self, trace_dir: str | Path, run_id: str | None, stream_to: Any, options: dict[str, Any]) -> str:
        unknown = sorted(set(options) - self.options)
        if unknown:
            raise TraceSchemaError(f"start_trace option {unknown[0]!r} unknown; known: {sorted(self.options)}")
        with self._lock:
            if self.writer is not None:  # checked before a run folder is created for nothing
                raise TraceStateError(f"a trace is already being recorded (run {self.writer.run_id}): stop it first")
            writer = TraceWriter(trace_dir, run_id=run_id, **self.writer_args, **options)
            stream = None
            try:
                stream = None if stream_to is None else TraceStreamWriter(stream_to, writer.manifest)
                with nullcontext() if self.placements is None else self.placements.recording(writer):
                    self.target.trace_attach(writer if stream is None else TeeSink(writer, stream), writer)
            except BaseException:
                if stream is not None:
                    stream.close()
                writer.close()  # a stream that cannot open, or a target that refuses, leaves no run recording
                raise
            self.writer, self._stream = writer, stream
            return str(writer.run_id)

    def _detach(self, after_loop: bool) -> dict[str, Any] | None:
        with self._lock:
            writer = self.writer
            if writer is None:
                return None
            if self.placements is not None:
                self.placements.stop_recording()
            self.target.trace_detach(after_loop)
            self.writer = None
            if self._stream is not None:
                self._stream.close()
                self._stream = None
            return dataclasses.asdict(writer.close())

    def stop(self) -> dict[str, Any] | None:
        """Commit and close; the manifest as a dict, or None when no trace was recording."""
        return self._detach(after_loop=False)

    def close_after_loop(self) -> None:
        """Engine shutdown, once the scheduler thread (or every rank) has ended, its requests finished as aborted."""
        self._detach(after_loop=True)

    def status(self) -> dict[str, Any]:
        """{"tracing": False} or the writer's WriterStatus fields with "tracing": True (any thread)."""
        writer = self.writer
        if writer is None:
            return {"tracing": False}
        return {"tracing": True, **dataclasses.asdict(writer.status())}
