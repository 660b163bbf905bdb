"""TraceControl: starts, stops and reports the engine's trace (one at a time), and closes it on every stop.

The writer is attached on the scheduler thread, between steps, so no forward is half in one run and half in
the next. On stop_trace the capturer drains its copies first (every computed row reaches the writer), and the
requests still running are written as finish_reason "unfinished". On engine shutdown the requests are aborted
first (they finish with finish_reason "abort", rows included), then the trace is closed (writer.py has the
durability contract).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

from r3trace.capture.capturer import RoutedExpertsCapturer
from r3trace.engine.event_loop import EventLoop
from r3trace.engine.route_capture import RouteCaptureHooks, TeeSink
from r3trace.trace.schema import TraceSchemaError, TraceStateError
from r3trace.trace.stream import TraceStreamWriter
from r3trace.trace.writer import TraceWriter


class TraceControl:
    def __init__(self, loop: EventLoop, capturer: RoutedExpertsCapturer, hooks: RouteCaptureHooks,
                 writer_args: dict[str, Any]) -> None:
        self.loop = loop
        self.capturer = capturer
        self.hooks = hooks
        self.writer_args = writer_args  # model shape, engine options, hashes: the manifest's fixed fields
        # what start_trace's caller may set: TraceWriter's other keywords (file size, flush interval, fsync, ...)
        fixed = set(writer_args) | {"self", "root", "run_id"}
        self.options = frozenset(inspect.signature(TraceWriter.__init__).parameters) - fixed

    @property
    def writer(self) -> Any:
        return self.hooks.writer

    def start(self, trace_dir: str | Path, run_id: str | None, stream_to: Any, options: dict[str, Any]) -> str:
        unknown = sorted(set(options) - self.options)
        if unknown:
            raise TraceSchemaError(f"start_trace option {unknown[0]!r} unknown; known: {sorted(self.options)}")
        if self.writer is not None:  # checked before a run folder is created for nothing
            raise TraceStateError(f"a trace is already being recorded (run {self.writer.run_id}): stop it first")
        writer = TraceWriter(trace_dir, run_id=run_id, **self.writer_args, **options)
        try:
            stream = None if stream_to is None else TraceStreamWriter(stream_to, writer.manifest)
        except BaseException:
            writer.close()  # a stream that cannot open leaves no run marked as recording
            raise

        def attach() -> None:
            if self.hooks.writer is not None:
                writer.close()
                raise TraceStateError("a trace is already being recorded: stop it first")
            self.capturer.attach_sink(writer if stream is None else TeeSink(writer, stream))
            self.hooks.writer = writer

        self.loop.call(attach)
        return str(writer.run_id)

    def _detach(self) -> Any:
        """On the scheduler thread (or after it stopped): drain, detach, close; the manifest or None."""
        writer, self.hooks.writer = self.hooks.writer, None
        if writer is None:
            return None
        sink = self.capturer.detach_sink()
        if isinstance(sink, TeeSink):
            sink.stream.close()
        return writer.close()

    def stop(self) -> dict[str, Any] | None:
        manifest = self.loop.call(self._detach)
        return None if manifest is None else dataclasses.asdict(manifest)

    def close_after_loop(self) -> None:
        """Engine shutdown, once the scheduler thread has ended (its requests finished as aborted)."""
        self._detach()

    def status(self) -> dict[str, Any]:
        """{"tracing": False} or the writer's WriterStatus fields with "tracing": True (any thread)."""
        writer = self.writer
        if writer is None:
            return {"tracing": False}
        return {"tracing": True, **dataclasses.asdict(writer.status())}
