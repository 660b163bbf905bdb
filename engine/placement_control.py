"""PlacementControl: Engine.update_expert_placement and Engine.expert_slots, in one process or over the ranks.

One process: each chunk of layers is one call on the scheduler thread (EventLoop.call settles the step in flight
first), so steps run between chunks. Several processes: named calls every rank runs at the same lockstep
iteration (engine/launch/lockstep.py): expert_placement_begin hands every rank the ExpertLocation, then one
expert_placement_step per chunk until every rank says done. Either way EngineCore.begin_expert_placement /
expert_placement_step do the work (expert_placement.update_chunks: a chunk's moved slots copied, then its maps).
"""

from __future__ import annotations

import threading
from typing import Any

from r3trace.engine.engine_core import EngineCore
from r3trace.engine.expert_placement import read_location
from r3trace.engine.model_config import ModelConfig


class PlacementControl:
    def __init__(self, loop: Any, core: EngineCore | None, model_config: ModelConfig, ep_size: int,
                 tp_size: int) -> None:
        """loop: the EventLoop (core given) or the WorkerGroup (core None: the ranks hold the cores)."""
        self.loop, self.core, self.model_config = loop, core, model_config
        self.ep_size, self.tp_size = ep_size, tp_size
        self._lock = threading.Lock()  # one rebalance at a time: a rank holds one update's chunk iterator

    def update(self, source: Any, chunk_layers: int) -> dict[str, Any]:
        location = read_location(source, self.model_config, self.ep_size)
        with self._lock:
            core = self.core
            if core is None:
                self.loop.call("expert_placement_begin", location, chunk_layers)
                copied, chunks = [0] * self.tp_size, 0
                while (done := self.loop.call("expert_placement_step"))[0] is not None:
                    copied = [c + d.slots_copied for c, d in zip(copied, done, strict=True)]
                    chunks += 1
                return {"chunks": chunks, "slots_copied": copied}
            self.loop.call(lambda: core.begin_expert_placement(location, chunk_layers))
            total = chunks = 0
            while (one := self.loop.call(core.expert_placement_step)) is not None:
                total, chunks = total + one.slots_copied, chunks + 1
            return {"chunks": chunks, "slots_copied": [total]}

    def slots(self) -> list[dict[str, Any]]:
        if self.core is None:
            return list(self.loop.call("expert_slots"))
        return [self.loop.call(self.core.expert_slots)]
