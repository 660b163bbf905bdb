"""WorkerGroup: the front end's side of a multi-process engine. Engine holds it where one process holds its
EventLoop, and calls the same methods (claim_rid, submit, abort, wait, stream, flush_cache, shutdown).

Messages go to the control rank (world rank 0) over one queue; everything comes back over another, in batches
the control rank gathered from every rank (engine/launch/lockstep.py): results and stream chunks, trace rows
and request summaries (fed to the one TraceWriter, which lives here), call replies, ready / bye / fatal.

Watchdog: the receiver thread checks the ranks every WATCH_S while nothing arrives. A rank that died (killed,
or failed: the control rank reports a failure as "fatal") fails every request in flight with a result
carrying "error" (for a stream, the chunk's finish_reason is abort with the message), the other ranks are
stopped, and every later call says the engine has stopped. Ranks also give up on collectives after
LaunchConfig.collective_timeout_s, so none waits forever on a dead peer.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import shutil
import sys
import tempfile
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.event_loop import Sink, stream_chunks
from r3trace.engine.launch.config import LaunchConfig
from r3trace.engine.launch.controller import DpController
from r3trace.engine.launch.lockstep import ALL_RANK_CALLS, CallRefused
from r3trace.engine.launch.members import STOP_S, Member, ProcessMember, ThreadMember, failure_cause
from r3trace.engine.launch.worker import WorkerSpec, rank_main
from r3trace.engine.request import InvalidRequestError, Req
from r3trace.engine.result import error_result

log = logging.getLogger(__name__)
WATCH_S = 0.2  # the watchdog's period: a dead rank fails its requests within about this long


@dataclass
class _Pending:
    sink: Sink[dict[str, Any]] | None
    dp_rank: int = -1


@dataclass
class _Call:
    expected: int
    values: list[Any] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    on_first: Callable[[Any], None] | None = None  # run by the receiver on the first reply, before later items


class WorkerGroup:
    def __init__(self, launch: LaunchConfig, inbox: Any, from_ranks: Any, members: list[Member],
                 cleanup: Path | None = None) -> None:
        self.launch = launch
        self.inbox = inbox  # front end -> control rank
        self.from_ranks = from_ranks  # control rank -> front end
        self.members = members
        self.cleanup = cleanup  # the rendezvous folder of spawned ranks
        self.controller = DpController(launch.dp_size, launch.load_balance_method)
        self.reporting = len(launch.reporting_ranks())
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}  # rid -> its sink (None between claim_rid and submit)
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._trace: tuple[Any, Any] | None = None  # (row sink, writer) while a trace records
        self._ready = 0
        self._byes = 0
        self.ready = threading.Event()
        self.dead: str | None = None  # why the ranks stopped, once they have
        self._closed = False
        self._receiver = threading.Thread(target=self._receive, name="r3trace-front-end", daemon=True)
        self._receiver.start()

    @classmethod
    def spawn(cls, model_path: Path, config: EngineConfig, launch: LaunchConfig, start_timeout_s: float = 600.0
              ) -> WorkerGroup:
        """tp_size rank processes (start method spawn), each building its shard; returns once all are ready."""
        ctx = mp.get_context("spawn")
        store = Path(tempfile.mkdtemp(prefix=f"r3trace-ranks-{os.getpid()}-"))  # named for its front end: tests find it
        cuda = config.device.startswith("cuda")
        threads = 0 if cuda else max(1, (os.cpu_count() or 1) // launch.tp_size)  # ranks share the cores
        spec = WorkerSpec(Path(model_path), config, launch, f"file://{store / 'store'}", threads, os.getpid())
        inbox, from_ranks = ctx.Queue(), ctx.Queue()
        members: list[Member] = []
        # A spawned child re-runs the parent's __main__ first (a test runner's, a notebook's, a dashboard's); the
        # ranks need only r3trace, so they start from a blank one and the real one is put back once they run.
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            for rank in range(launch.tp_size):
                p = ctx.Process(target=rank_main, args=(rank, spec, inbox, from_ranks), daemon=True,
                                name=f"r3trace-rank-{rank}")
                p.start()
                members.append(ProcessMember(rank, p))
        finally:
            sys.modules["__main__"] = main
        return cls._started(cls(launch, inbox, from_ranks, members, cleanup=store), start_timeout_s)

    @classmethod
    def beside_rank0(cls, model_path: Path, config: EngineConfig, launch: LaunchConfig,
                     start_timeout_s: float = 600.0) -> WorkerGroup:
        """Under torchrun, on world rank 0: that rank's loop in a thread of this process (queue.Queue both ways),
        the other ranks being torchrun's processes; returns once all are ready."""
        from r3trace.engine.launch.worker import run_rank

        spec = WorkerSpec(Path(model_path), config, launch, "env://")
        inbox: queue.Queue[Any] = queue.Queue()
        from_ranks: queue.Queue[Any] = queue.Queue()
        thread = threading.Thread(target=run_rank, args=(spec, 0, inbox, from_ranks), name="r3trace-rank-0",
                                  daemon=True)
        thread.start()
        return cls._started(cls(launch, inbox, from_ranks, [ThreadMember(thread)]), start_timeout_s)

    @staticmethod
    def _started(group: WorkerGroup, start_timeout_s: float) -> WorkerGroup:
        if not group.ready.wait(start_timeout_s) or group.dead is not None:
            reason = group.dead or f"the ranks were not ready after {start_timeout_s:g} s"
            group.shutdown()
            raise RuntimeError(f"the engine's ranks failed to start: {reason}")
        return group

    # ------------------------------------------------------------------ caller side (any thread)
    def claim_rid(self, rid: str) -> None:
        with self._lock:
            self._check_alive()
            if rid in self._pending:
                raise InvalidRequestError("rid", f"{rid!r} is already in flight")
            self._pending[rid] = _Pending(None)

    def submit(self, reqs: list[tuple[Req, Sink[dict[str, Any]]]]) -> None:
        """Assign each request a DP rank (req.routed_dp_rank pins it) and send them as one message."""
        batch: list[tuple[Req, int]] = []
        with self._lock:
            if self.dead is not None:  # died since claim_rid: the watchdog already failed everything else
                for req, sink in reqs:
                    sink.put(error_result(req.rid, f"engine rank failure: {self.dead}", req.prompt_len))
                return
            for req, sink in reqs:
                dp_rank = self.controller.assign(req.routed_dp_rank)
                self._pending[req.rid] = _Pending(sink, dp_rank)
                req.generator = None  # rebuilt from the seed on the rank (a generator does not cross processes)
                batch.append((req, dp_rank))
            self.inbox.put(("submit", batch))

    def abort(self, rid: str) -> None:
        if self.dead is None:
            self.inbox.put(("abort", rid))

    def call(self, name: str, *args: Any, on_first: Callable[[Any], None] | None = None) -> list[Any]:
        """Run a named operation on every rank between steps; the reporting ranks' answers (every rank's for
        ALL_RANK_CALLS), in rank order. A rank that refused it (CallRefused: the same on every rank) raises here.
        on_first(answer): run on the receiver thread with the first answer to arrive, before it hands on anything
        the ranks sent after their answers (the rows of later forwards: a rank's items arrive in its order)."""
        expected = self.launch.tp_size if name in ALL_RANK_CALLS else self.reporting
        with self._lock:
            self._check_alive()
            call_id = next(self._call_ids)
            pending = self._calls[call_id] = _Call(expected, on_first=on_first)
            self.inbox.put(("call", call_id, name, args))
        pending.done.wait()
        if self.dead is not None and len(pending.values) < expected:
            raise RuntimeError(f"the engine's ranks have stopped: {self.dead}")
        refused = [v for v in pending.values if isinstance(v, CallRefused)]
        if refused:
            raise refused[0].error
        return pending.values

    def flush_cache(self) -> bool:
        return all(self.call("flush_cache"))

    def trace_attach(self, sink: Any, writer: Any) -> None:
        self._trace = (sink, writer)
        try:
            self.call("trace_on")
        except BaseException:
            self._trace = None
            raise

    def trace_detach(self, after_loop: bool = False) -> None:
        """After it returns every row the ranks captured has reached the writer (trace_off drains them first)."""
        if not after_loop and self.dead is None:
            self.call("trace_off")
        self._trace = None

    def wait(self, sink: Sink[dict[str, Any]]) -> dict[str, Any]:
        # The watchdog puts an error result in every sink whose request cannot finish; the receiver thread
        # itself ending early (a bug) must not leave the caller waiting either.
        while True:
            try:
                return sink.get(timeout=WATCH_S)
            except queue.Empty:
                if not self._receiver.is_alive() and sink.empty():
                    raise RuntimeError("the engine's front end has stopped") from None

    def stream(self, rid: str, sink: Sink[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        return stream_chunks(self.wait, self.abort, rid, sink)

    def shutdown(self) -> None:
        """Ranks abort what is in flight (results come back), say bye and exit; then they are joined (killed
        after STOP_S). Idempotent; also after the ranks died."""
        if self._closed:
            return
        self._closed = True
        if self.dead is None:
            self.inbox.put(("shutdown", None))
            # Ranks stop between steps; one stuck in a step fails its collectives within their timeout.
            self._receiver.join(self.launch.collective_timeout_s + STOP_S)
            if self._receiver.is_alive():
                self._fail(f"the ranks did not stop within {self.launch.collective_timeout_s + STOP_S:g} s")
        for m in self.members:
            m.stop()
        if self.cleanup is not None:
            shutil.rmtree(self.cleanup, ignore_errors=True)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise RuntimeError(f"the engine's ranks have stopped: {self.dead}")

    # ------------------------------------------------------------------ receiver thread
    def _receive(self) -> None:
        while self._byes < self.launch.tp_size and self.dead is None:
            try:
                batch = self.from_ranks.get(timeout=WATCH_S)
            except queue.Empty:
                gone = [m for m in self.members if not m.is_alive()]
                if gone:
                    self._fail(gone[0].describe())
                continue
            for item in batch:
                try:
                    self._dispatch(item)
                except Exception:  # one bad item (a closed writer) must not stop results reaching callers
                    log.exception("front end: could not handle %s from the ranks", item[0])

    def _dispatch(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "out":
            _, rid, result = item
            finished = result["meta_info"]["finish_reason"] is not None
            with self._lock:
                entry = self._pending.pop(rid, None) if finished else self._pending.get(rid)
                if entry is not None and finished:
                    self.controller.finished(entry.dp_rank)
            if entry is not None and entry.sink is not None:
                entry.sink.put(result)
        elif kind == "rows":
            if self._trace is not None:
                self._trace[0].append_tokens(*item[1], **item[2])
        elif kind == "summary":
            if self._trace is not None:
                self._trace[1].add_request(item[1], **item[2])
        elif kind == "reply":
            _, call_id, _rank, value = item
            call = self._calls[call_id]
            if not call.values and call.on_first is not None and not isinstance(value, CallRefused):
                try:
                    call.on_first(value)
                except Exception:  # the caller still gets its answers
                    log.exception("front end: the first answer's hook failed")
            call.values.append(value)
            if len(call.values) == call.expected:
                del self._calls[call_id]
                call.done.set()
        elif kind == "ready":
            self._ready += 1
            if self._ready == self.launch.tp_size:
                self.ready.set()
        elif kind == "bye":
            self._byes += 1
        elif kind == "fatal":
            self._fail(failure_cause(self.members, self.members[item[1]], item[2]))

    def _fail(self, reason: str) -> None:
        """The ranks cannot go on: every request in flight gets an error result, every call returns, the other
        ranks are stopped."""
        log.error("engine ranks stopped: %s", reason)
        with self._lock:
            self.dead = reason
            pending, self._pending = self._pending, {}
            calls, self._calls = list(self._calls.values()), {}
        message = f"engine rank failure: {reason}"
        for rid, entry in pending.items():
            if entry.sink is not None:
                entry.sink.put(error_result(rid, message))
        for call in calls:
            call.done.set()
        self.ready.set()
        for m in self.members:
            if m.is_alive() and isinstance(m, ProcessMember):
                m.process.terminate()
