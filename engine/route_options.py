"""What a request asks of routing: the routes to return (CaptureRequest, Req.capture) and the routes to force
(ReplayRoutes, Req.replay). Both are set once when the request is built (engine/engine.py) and read by the
route hooks (engine/route_capture.py), the replay plan of each forward (engine/replay.py) and the results.

Shape legend: L num_hidden_layers, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from r3trace.capture.route_rows import RouteRows


@dataclass
class CaptureRequest:
    """A request's capture options; `rows` and `provenance` are filled when it finishes."""

    want: bool
    start_len: int = 0
    weights: bool = False
    tag: str | None = None
    arrival_ns: int = 0
    rows: RouteRows | None = None  # assembled at finish, before the KV is freed
    provenance: list[tuple[int, int, str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class ReplayRoutes:
    """A request's forced routes: ids [n, L, K] int32 for positions [start, start + n).

    Row i forces position start + i: its ids on every MoE layer, with weights the gate's own scores at
    those ids (engine/layers/router.py). docs/replay.md states the contract."""

    ids: np.ndarray
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.ids)
