"""RankLoop: the loop every rank of a multi-process engine runs; all ranks take each step together.

The model has collectives inside, so every rank must enter every forward, in the same order. One iteration:

1. the control rank (world rank 0) takes the front end's new messages (requests with their DP rank, aborts,
   calls, shutdown) and broadcasts them over the CPU group; it waits for one only while no rank has work;
2. each rank applies those for its DP rank (the ranks of one DP group apply the same ones, in the same order,
   to identical schedulers, so they schedule identically);
3. the ranks all-gather whether each has work (and check that a DP group agrees, which catches a divergence
   as an error instead of a hang); if any has, every rank runs one forward: its own batch, or under DP
   attention the idle batch (ModelRunner.run_idle) when it has none;
4. results and trace rows of attention-TP rank 0 of each DP group go to the control rank in one gather, and
   on to the front end.

Each rank runs its scheduler unoverlapped (one forward launched and processed per iteration): the overlapped
scheduler's step ahead would need the step decision for step i+1 before step i is processed.
"""

from __future__ import annotations

import logging
import os
import queue
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from r3trace.engine.engine_core import EngineCore
from r3trace.engine.layers.expert_location import ExpertLocationError
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.request import Req

log = logging.getLogger(__name__)
# Calls whose answer differs by rank (expert parallelism's slots): every rank replies, not only the reporting ones.
ALL_RANK_CALLS = frozenset({"expert_placement_begin", "expert_placement_step", "expert_slots", "expert_map"})


class CallRefused(NamedTuple):
    """A call every rank refused alike (a bad placement): the ranks go on; the front end raises error."""

    error: Exception

IDLE_WAIT_S = 0.05  # how long the control rank waits for a message while no rank has work (others wait with it)
Outbox = list  # items for the front end, collected over one iteration


class OutboxSink:
    """The event loop's per-request sink on a reporting rank: results and stream chunks to the front end."""

    def __init__(self, rid: str, outbox: Outbox) -> None:
        self.rid = rid
        self.outbox = outbox

    def put(self, result: dict[str, Any]) -> None:
        self.outbox.append(("out", self.rid, result))


class NullSink:
    """Attention-TP ranks other than 0 compute the same results; one copy reaches the front end."""

    def put(self, result: dict[str, Any]) -> None:
        pass


class TraceForwarder:
    """The capturer's trace sink and the route hooks' writer on a rank while a trace records: the front end's
    TraceWriter gets the same calls. Every rank of a DP group attaches one (the capture state, which decides
    prefix reuse, must be the same on all of them); only the reporting rank's forwards anything, so each
    (request, position, layer) reaches the trace once. A DP group captures only its own requests, so every row it
    forwards is stamped with its DP rank (prefix-cache rows included). Arrays are copied: the capturer reuses its
    buffers."""

    DP_RANK_ARG = 6  # TraceSink.append_tokens(request_id, token_pos, phase, source, forward_id, ts, dp_rank, ...)

    def __init__(self, outbox: Outbox, reporting: bool, dp_rank: int) -> None:
        self.outbox = outbox
        self.reporting = reporting
        self.dp_rank = dp_rank

    def append_tokens(self, *args: Any, **kwargs: Any) -> None:
        if not self.reporting:
            return
        copy = [np.array(a) if isinstance(a, np.ndarray) else a for a in args]
        kw = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
        if len(copy) > self.DP_RANK_ARG:
            copy[self.DP_RANK_ARG] = self.dp_rank
        else:
            kw["dp_rank"] = self.dp_rank
        self.outbox.append(("rows", copy, kw))

    def add_request(self, request_id: str, **kwargs: Any) -> None:
        if self.reporting:
            self.outbox.append(("summary", request_id, kwargs))


class RankLoop:
    def __init__(
        self, core: EngineCore, parallel: ParallelInfo, cpu_group: Any, inbox: Any = None, to_front: Any = None,
        front_pid: int | None = None,
    ) -> None:
        """cpu_group: a gloo group over the world (host-side collectives). inbox / to_front: the control rank's
        queues from and to the front end (None on the other ranks). front_pid: the spawning front end's pid; the
        control rank stops when it is gone (a killed front end runs no shutdown), and the others with it."""
        self.core = core
        self.parallel = parallel
        self.cpu_group = cpu_group
        self.inbox = inbox
        self.to_front = to_front
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.reporting = parallel.attn_tp_rank == 0
        self.front_pid = front_pid
        self.outbox: Outbox = []
        self.forwarder = TraceForwarder(self.outbox, self.reporting, parallel.dp_rank)

    # ------------------------------------------------------------------ collectives over the CPU group
    def _broadcast(self, msgs: list[Any] | None) -> list[Any]:
        box = [msgs]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0] or []

    def _work_everywhere(self, mine: bool) -> np.ndarray:
        """[world] bool: which ranks have work this step. The ranks of a DP group must agree."""
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(flags, torch.tensor([int(mine)]), group=self.cpu_group)
        work = torch.cat(flags).numpy().astype(bool)
        group = work.reshape(self.parallel.dp_size, self.parallel.attn_tp_size)
        if (group != group[:, :1]).any():
            d = int(np.flatnonzero((group != group[:, :1]).any(axis=1))[0])
            raise RuntimeError(f"DP group {d} diverged: its ranks disagree on having work ({group[d].tolist()})")
        return work

    def _send(self, extra: list[Any] | None = None) -> None:
        """Every rank's outbox to the control rank, which hands them to the front end in rank order."""
        items, self.outbox[:] = list(self.outbox) + (extra or []), []
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(items, gathered, dst=0, group=self.cpu_group)
        if gathered is not None:
            batch = [item for part in gathered for item in part]
            if batch:
                self.to_front.put(batch)

    # ------------------------------------------------------------------ the loop
    def _take(self, block: bool) -> list[Any]:
        msgs: list[Any] = []
        try:
            msgs.append(self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait())
            while True:
                msgs.append(self.inbox.get_nowait())
        except queue.Empty:
            if self.front_pid is not None and os.getppid() != self.front_pid:
                raise RuntimeError(f"the front end (pid {self.front_pid}) is gone") from None
            return msgs

    def run(self) -> None:
        """Until a shutdown message; any exception is fatal to the rank (its peers are in the same collectives)."""
        busy = False
        with torch.inference_mode():
            self._send([("ready", self.rank)])
            while True:
                msgs = self._broadcast(self._take(block=not busy) if self.rank == 0 else None)
                if not all([self._apply(m) for m in msgs]):
                    self.core.scheduler.abort_all("the engine was shut down")
                    self.core.loop.deliver()
                    if self.core.capturer is not None and self.core.capturer.sink is not None:
                        self.core.capturer.drain()  # every captured row reaches the front end's writer
                    self._send([("bye", self.rank)])
                    return
                work = self._work_everywhere(self.core.scheduler.has_work())
                busy = bool(work.any())
                if busy:
                    stepped = bool(work[self.rank]) and self.core.loop.step_once()
                    if not stepped and self.parallel.dp_size > 1:
                        self.core.runner.run_idle()
                self.core.loop.deliver()
                self._send()

    def _apply(self, msg: tuple[Any, ...]) -> bool:
        kind = msg[0]
        loop = self.core.loop
        if kind == "submit":
            mine = [req for req, dp_rank in msg[1] if dp_rank == self.parallel.dp_rank]
            for req in mine:
                self._own(req)
            if mine:
                loop.handle(("submit", [(r, OutboxSink(r.rid, self.outbox) if self.reporting else NullSink())
                                        for r in mine]))
        elif kind == "abort":
            loop.handle(("abort", msg[1]))  # unknown ids are ignored: every DP rank may get it
        elif kind == "call":
            _, call_id, name, args = msg
            try:
                value = self._call(name, *args)
            except ExpertLocationError as exc:  # checked alike on every rank before anything changed
                value = CallRefused(exc)
            if self.reporting or name in ALL_RANK_CALLS:
                self.outbox.append(("reply", call_id, self.rank, value))
        elif kind == "shutdown":
            return False
        return True

    def _own(self, req: Req) -> None:
        """A request unpickled on this rank: a seeded one gets its generator here (the front end sends none)."""
        if req.params.seed is not None:
            req.generator = self.core.sampler.request_generator(req.params.seed)

    def _call(self, name: str, *args: Any) -> Any:
        core = self.core
        if name == "expert_placement_begin":
            return core.begin_expert_placement(*args)
        if name == "expert_placement_step":
            return core.expert_placement_step()
        if name == "expert_slots":
            return core.expert_slots()
        if name == "expert_map":
            return core.expert_map()
        if name == "flush_cache":
            return core.loop.flush_if_idle()
        if name == "recompute_mismatches":
            return 0 if core.capturer is None else core.capturer.recompute_mismatches
        if name == "trace_on":
            assert core.capturer is not None and core.route_hooks is not None
            core.capturer.attach_sink(self.forwarder)
            core.route_hooks.writer = self.forwarder
            return True
        if name == "trace_off":  # drains: every computed row reaches the outbox before the reply
            assert core.capturer is not None and core.route_hooks is not None
            core.route_hooks.writer = None
            core.capturer.detach_sink()
            return True
        raise ValueError(f"call {name!r} unknown to the ranks")
