"""PlacementControl: Engine.update_expert_placement and Engine.expert_slots, in one process or over the ranks.

One process: each chunk of layers is one call on the scheduler thread (EventLoop.call settles the step in flight
first), so steps run between chunks. Several processes: named calls every rank runs at the same lockstep
iteration (engine/launch/lockstep.py): expert_placement_begin hands every rank the ExpertLocation, then one
expert_placement_step per chunk until every rank says done. Either way EngineCore.begin_expert_placement /
expert_placement_step do the work (expert_placement.update_chunks: a chunk's moved slots copied, then its maps).

While a trace records, the trace's placements table (r3trace/trace/placements.py) gets the map in force when the
trace starts and each chunk's new rows as it switches, with the forward they apply from. One lock orders the two:
a chunk never switches between the start's snapshot and the moment the trace's writer is set, so every row the
trace holds ran under a map it records.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from r3trace.engine.engine_core import EngineCore
from r3trace.engine.expert_placement import ChunkDone, read_location
from r3trace.engine.layers.expert_location import ExpertLocation
from r3trace.engine.model_config import ModelConfig
from r3trace.trace.writer import TraceWriter

log = logging.getLogger(__name__)


class PlacementControl:
    def __init__(self, loop: Any, core: EngineCore | None, model_config: ModelConfig, ep_size: int,
                 tp_size: int) -> None:
        """loop: the EventLoop (core given) or the WorkerGroup (core None: the ranks hold the cores)."""
        self.loop, self.core, self.model_config = loop, core, model_config
        self.ep_size, self.tp_size = ep_size, tp_size
        self._lock = threading.Lock()  # one rebalance at a time: a rank holds one update's chunk iterator
        self._record = threading.Lock()  # a chunk's switch and its record, or a trace's snapshot and attach
        self._writer: TraceWriter | None = None  # the recording trace's writer

    def update(self, source: Any, chunk_layers: int) -> dict[str, Any]:
        location = read_location(source, self.model_config, self.ep_size)
        with self._lock:
            core = self.core
            if core is None:
                self.loop.call("expert_placement_begin", location, chunk_layers)
            else:
                self.loop.call(lambda: core.begin_expert_placement(location, chunk_layers))
            copied, chunks = [0] * (self.tp_size if core is None else 1), 0
            while (done := self._step(location)) is not None:
                copied = [c + d.slots_copied for c, d in zip(copied, done, strict=True)]
                chunks += 1
            return {"chunks": chunks, "slots_copied": copied}

    def _step(self, location: ExpertLocation) -> list[ChunkDone] | None:
        """One chunk on every rank, recorded in the trace if one records: per rank its ChunkDone, None when done.
        The record is written where the switch is first seen, before any row of a later forward reaches the
        writer: on the scheduler thread (one process) or on the front end's receiver thread with the first rank's
        answer (several), so a kill never commits rows whose map is not yet listed."""

        def record(done: ChunkDone | None) -> None:
            writer = self._writer  # read once: stop_recording may clear it meanwhile
            if done is None or writer is None:
                return
            rows = location.physical_to_logical[[location.row(i) for i in done.layer_ids]].numpy()
            try:
                writer.add_placement(done.from_forward_id, done.layer_ids, rows)
            except Exception as exc:  # the switch happened: the rebalance goes on, the log says what the trace lacks
                log.warning("trace %s: the placement of layers %s from forward %d was not recorded: %s",
                            writer.run_id, list(done.layer_ids), done.from_forward_id, exc)

        with self._record:
            core = self.core
            if core is None:
                done = list(self.loop.call("expert_placement_step", on_first=record))
            else:
                def step() -> ChunkDone | None:
                    one = core.expert_placement_step()
                    record(one)
                    return one

                done = [self.loop.call(step)]
            return None if done[0] is None else done

    def slots(self) -> list[dict[str, Any]]:
        if self.core is None:
            return list(self.loop.call("expert_slots"))
        return [self.loop.call(self.core.expert_slots)]

    def running(self) -> tuple[int, tuple[int, ...], np.ndarray]:
        """(forward_id, MoE layer ids, phy2log [L, P]): the map every rank runs from the next forward on."""
        return running_map(list(self.loop.call("expert_map")) if self.core is None
                           else [self.loop.call(self.core.expert_map)])

    @contextmanager
    def recording(self, writer: TraceWriter) -> Iterator[None]:
        """Around a trace's attach: the map in force is written first, no chunk switches until the block ends, and
        from then on each chunk's switch is recorded in `writer` (until stop_recording)."""
        with self._record:
            forward_id, layer_ids, phy2log = self.running()
            writer.add_placement(forward_id, layer_ids, phy2log)
            yield
            self._writer = writer

    def stop_recording(self) -> None:
        """No lock: a shutdown must not wait on a rebalance stuck in a call its stopped loop never serves; a chunk
        recorded while the writer closes is refused by it (TraceWriter.add_placement) and logged."""
        self._writer = None


def running_map(ranks: list[dict[str, Any]]) -> tuple[int, tuple[int, ...], np.ndarray]:
    """EngineCore.expert_map of every rank -> (forward_id, MoE layer ids, phy2log [L, P]): the EP ranks' slots end to
    end (slot p of EP rank r is global slot r P / G + p); attention-TP peers of one EP rank hold the same slots and
    count once."""
    by_ep = {r["ep_rank"]: r for r in reversed(ranks)}  # the first rank of each EP rank
    ep = [by_ep[k] for k in sorted(by_ep)]
    layer_ids = tuple(ep[0]["layer_ids"])
    phy2log = np.array([[e for r in ep for e in r["held"][i]] for i in range(len(layer_ids))], dtype=np.int64)
    return int(ep[0]["forward_id"]), layer_ids, phy2log
