"""EventLoop: the scheduler thread, the only owner of scheduling state (requests, KV, the model).

Callers (any number of threads) reach it through one thread-safe inbox: submit a list of requests as one
message (so a single-threaded offline caller always gets the same batches, hence the same tokens), abort,
run a function on the thread, shut down. Results, or stream chunks, come back on a per-request queue.

Overlap (EngineConfig.overlap_schedule, SGLang's overlap scheduler): while the GPU runs step i, the host
processes step i-1 and schedules and launches step i+1, whose decode inputs are step i's tokens read on the
device. A request that stops on a token sampled at step i was already given a position in step i+1: process
drops that position (Scheduler._drop_ahead) and ignores the step's row for it. Steps that need the host to
see step i first (admissions, chunked prefill, retraction) are scheduled after it is processed. A message
from a caller (abort, call, shutdown, a new submission) is handled after the step in flight is processed,
so nothing else ever sees a request with positions in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from r3trace.engine.model_config import ModelConfig
from r3trace.engine.model_runner import Launched, ModelRunner
from r3trace.engine.radix_cache import RadixCache
from r3trace.engine.request import InvalidRequestError, Req
from r3trace.engine.result import build_result
from r3trace.engine.route_capture import RouteCaptureHooks, route_meta
from r3trace.engine.scheduler import Scheduler
from r3trace.engine.tokenizer import TextTokenizer

log = logging.getLogger(__name__)
Sink = queue.Queue  # per request: result dicts (or stream chunks) back to the caller's thread
_POLL_S = 0.5  # how often a waiting caller checks that the scheduler thread is still alive
T = TypeVar("T")


def stream_chunks(
    wait: Callable[[Sink[dict[str, Any]]], dict[str, Any]], abort: Callable[[str], None], rid: str,
    sink: Sink[dict[str, Any]],
) -> Iterator[dict[str, Any]]:
    """A request's stream chunks until the one with a finish_reason; a caller that stops iterating aborts it (one
    process's EventLoop and the multi-process front end both stream through this)."""
    done = False
    try:
        while not done:
            chunk = wait(sink)
            done = chunk["meta_info"]["finish_reason"] is not None
            yield chunk
    finally:
        if not done:  # the caller stopped iterating: stop generating for it
            abort(rid)


class EventLoop:
    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, cache: RadixCache | None,
        route_hooks: RouteCaptureHooks | None, model_config: ModelConfig, tokenizer: TextTokenizer,
        overlap: bool = False, threaded: bool = True,
    ) -> None:
        """threaded=False: no thread of its own; a rank's lockstep driver (engine/launch/lockstep.py) calls
        handle / step_once / deliver instead, in an order every rank shares."""
        self.scheduler = scheduler
        self.overlap = overlap
        self._inflight: Launched | None = None  # the step launched and not yet processed
        self.runner = runner
        self.cache = cache
        self.route_hooks = route_hooks
        self.model_config = model_config
        self.tokenizer = tokenizer
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._sinks: dict[str, Sink[dict[str, Any]]] = {}  # scheduler thread only
        self._live_rids: set[str] = set()
        self._rid_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="r3trace-scheduler", daemon=True)
        if threaded:
            self._thread.start()

    # ------------------------------------------------------------------ caller side
    def claim_rid(self, rid: str) -> None:
        with self._rid_lock:
            if rid in self._live_rids:
                raise InvalidRequestError("rid", f"{rid!r} is already in flight")
            self._live_rids.add(rid)

    def submit(self, reqs: list[tuple[Req, Sink[dict[str, Any]]]]) -> None:
        self._inbox.put(("submit", reqs))

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def shutdown(self) -> None:
        self._inbox.put(("shutdown", None))
        self._thread.join()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the scheduler thread and return its result (or raise its exception here). RuntimeError if the
        thread stopped without running it (a call queued behind shutdown: a placement update racing it)."""
        box: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._inbox.put(("call", (fn, box)))
        ok, value = self._get_while_alive(box)
        if not ok:
            raise value
        return value

    def flush_cache(self) -> bool:
        return bool(self.call(self.flush_if_idle))

    def wait(self, sink: Sink[dict[str, Any]]) -> dict[str, Any]:
        return self._get_while_alive(sink)

    def _get_while_alive(self, box: queue.Queue[T]) -> T:
        """box's next item; RuntimeError once the scheduler thread has ended without putting one. The box is read
        once more after the thread is seen dead: an item put just before it ended (shutdown's abort results, a
        call's answer) is still returned."""
        while True:
            try:
                return box.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive():
                    try:
                        return box.get_nowait()
                    except queue.Empty:
                        raise RuntimeError("the engine's scheduler thread has stopped") from None

    def stream(self, rid: str, sink: Sink[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        return stream_chunks(self.wait, self.abort, rid, sink)

    def flush_if_idle(self) -> bool:
        """On the scheduler thread: drop the prefix cache's unlocked entries unless requests are in flight."""
        if self._inflight is not None or self.scheduler.has_work():
            return False
        if self.cache is not None:
            self.cache.flush()
        return True

    # ------------------------------------------------------------------ scheduler thread
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                busy = self._inflight is not None or self.scheduler.has_work()
                try:
                    msg = self._inbox.get(block=not busy)
                except queue.Empty:
                    msg = None
                if msg is not None and self._inflight is not None:
                    self._settle()  # messages see no request with positions in flight
                while msg is not None:
                    if not self.handle(msg):
                        self.scheduler.abort_all("the engine was shut down")
                        self.deliver()
                        return
                    try:
                        msg = self._inbox.get_nowait()
                    except queue.Empty:
                        msg = None
                if self._inflight is not None or self.scheduler.has_work():
                    self._step()
                self.deliver()

    def handle(self, msg: tuple[str, Any]) -> bool:
        """Apply one caller message; False on shutdown."""
        kind, body = msg
        if kind == "submit":
            for req, sink in body:
                self._sinks[req.rid] = sink
                self.scheduler.add(req)
        elif kind == "abort":
            self.scheduler.abort(body)
        elif kind == "call":
            fn, box = body
            try:
                box.put((True, fn()))
            except Exception as exc:  # handed back to the caller's thread
                box.put((False, exc))
        elif kind == "shutdown":
            return False
        return True

    def _step(self) -> None:
        self._guarded(self._advance)

    def _settle(self) -> None:
        """Process the step in flight (waits for it on the device)."""
        self._guarded(self._process_inflight)

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            log.exception("engine step failed; aborting the requests in flight")
            self._inflight = None
            self.scheduler.abort_all(f"engine error: {exc!r}", is_error=True)

    def _advance(self) -> None:
        if self._inflight is None:
            items = self.scheduler.schedule()
            if not items:
                # Unreachable while the pool holds any prompt it accepted; never spin on it.
                self.scheduler.abort_all("the scheduler could not place any request", is_error=True)
                return
            self._inflight = self.runner.launch(items)
            if not self.overlap:
                self._process_inflight()
            return
        ahead = self.scheduler.schedule_ahead(self._inflight.items)
        done, self._inflight = self._inflight, None
        if ahead:
            self._inflight = self.runner.launch(ahead)  # queued behind `done` on the GPU
        self._process(done)

    def _process_inflight(self) -> None:
        done, self._inflight = self._inflight, None
        if done is not None:
            self._process(done)

    def _process(self, done: Launched) -> None:
        for items, outputs in self.runner.results(done):
            self.scheduler.process(items, outputs)

    def _with_routes(self, req: Req, result: dict[str, Any], delta: bool) -> dict[str, Any]:
        opts = req.capture
        if opts is None or not opts.want or self.route_hooks is None:
            return result
        rows = opts.rows if req.finished else self.route_hooks.stream_rows(req)
        if rows is not None:
            result["meta_info"].update(route_meta(rows, self.model_config, opts.weights, delta, opts.start_len))
            if req.finished:
                result["meta_info"]["routed_experts_provenance"] = [list(seg) for seg in opts.provenance]
        return result

    def step_once(self) -> bool:
        """One unguarded, unoverlapped step for a lockstep rank: False when the scheduler placed nothing (the
        rank then runs the idle forward). An exception propagates: under several ranks a failed step is fatal,
        since the other ranks are inside the same collectives."""
        items = self.scheduler.schedule()
        if not items:
            self.scheduler.abort_all("the scheduler could not place any request", is_error=True)
            return False
        self._process(self.runner.launch(items))
        return True

    def deliver(self) -> None:
        for req in self.scheduler.take_updates():
            sink = self._sinks.get(req.rid)
            if sink is None:
                continue
            if req.stream:
                sink.put(self._with_routes(req, build_result(req, self.tokenizer, delta=True), delta=True))
            elif req.finished:
                sink.put(self._with_routes(req, build_result(req, self.tokenizer, delta=False), delta=False))
            if req.finished:
                del self._sinks[req.rid]
                with self._rid_lock:
                    self._live_rids.discard(req.rid)
