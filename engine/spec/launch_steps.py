"""A chained speculative launch on the host: S greedy steps ran as one graph (greedy_step.py GreedyStep.chain); after
its one wait the host hands them to the recorder and the scheduler one step at a time, as if launched one by one.

Shape legend: S steps of the launch, B requests, bs the graph size, n = d + 1 rows a request a step.

Step s of request b verified positions p_s .. p_s + n - 1, p_0 = its item's start and p_{s+1} = p_s + count_s (the
device moved the batch by the committed count, GreedyStep.advance); its KV slots are that window of the item's
chain_slots, its routes capture rows s * bs * n + b * n .. + n - 1 (ForwardBatch.route_row0). For each step in order:
the recorder's end hook gets the step's batch as the host now knows it (StepView: forward id f + s, its slots, its
prefix lengths), then the scheduler processes it (acceptance, stop rules, rejected rows released to the capturer),
so a position a later step verified again is claimed by that step before it is read, as with separate launches.
A request that stopped at an earlier step is skipped by the scheduler; the recorder still sees its later windows
(the rows must stay one range), which it drops: the capturer forgot the request at its finish, and the claims on
its freed slots lose to the forward that is next given them (a copy lands only where its forward still owns the
slot: RouteBuffers.drain_one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from r3trace.capture.recorder import RouteRecorder, RowRange

from ..forward_batch import ForwardBatch, Phase
from ..model_runner import Launched
from ..step import ReqOutput, ScheduledReq


@dataclass
class StepsLaunched(Launched):
    """A chained launch in flight: host["out"] [S, B, n + 1] lands once event has passed."""

    fb: ForwardBatch | None = None  # the first step's batch (forward id f)
    graph_bs: int = 0  # bs: step s's routes start at capture row s * bs * n


@dataclass
class StepView:
    """One step of a chained launch as the recorder's BatchView, built on the host after the launch's wait."""

    forward_id: int
    out_cache_loc: torch.Tensor  # [T] int64, on the host: the recorder reads out_cache_loc_cpu
    out_cache_loc_cpu: np.ndarray | None
    positions: torch.Tensor  # [T] int64, on the host
    request_ids: list[str]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    row0: int  # the step's first row in the capture buffer
    phases: list[Phase] = field(default_factory=list)
    dp_rank: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    @property
    def route_rows(self) -> RowRange:
        return RowRange(self.row0, self.num_tokens)


def step_results(launched: StepsLaunched, recorder: RouteRecorder) -> Iterator[tuple[list[ScheduledReq],
                                                                                  list[ReqOutput]]]:
    """Wait for the launch, then each step's (items, outputs), its routes handed to the recorder first; the caller
    processes a step before asking for the next (a request it finishes drops out of the later steps)."""
    if launched.event is not None:
        launched.event.synchronize()
    assert launched.fb is not None
    out = launched.host["out"].numpy()  # [S, B, n + 1]
    steps, n = out.shape[0], out.shape[2] - 1
    items = launched.items
    starts = np.array([it.start for it in items], np.int64)  # [B] p_s
    for s in range(steps):
        if all(it.req.finished for it in items):
            return
        subs: list[ScheduledReq] = []
        for it, p in zip(items, starts.tolist(), strict=True):
            assert it.chain_slots is not None
            window = it.chain_slots[p - it.start : p - it.start + n]
            subs.append(dataclasses.replace(it, start=p, out_cache_loc=window, chain_slots=None,
                                            more_steps=s < steps - 1))
        slots = np.concatenate([it.out_cache_loc for it in subs])  # [B * n]
        positions = (starts[:, None] + np.arange(n)).reshape(-1)  # [B * n]
        view = StepView(forward_id=launched.fb.forward_id + s, out_cache_loc=torch.from_numpy(slots),
                        out_cache_loc_cpu=slots, positions=torch.from_numpy(positions),
                        request_ids=[it.req.rid for it in subs], prefix_lens_cpu=starts.tolist(),
                        extend_lens_cpu=[n] * len(subs), row0=s * launched.graph_bs * n,
                        phases=["verify"] * len(subs))
        if s:  # the first step's begin hook ran before the replay (it orders the replay after the last copy)
            recorder.on_forward_begin(view)
        recorder.on_forward_end(view)
        outs = [ReqOutput(next_tokens=row[: row[n]].tolist()) for row in out[s]]
        yield subs, outs
        starts = starts + out[s, :, n]
