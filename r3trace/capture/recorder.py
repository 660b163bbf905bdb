"""The recorder protocol: the one seam between the engine's routing op and route capture.

The engine's router calls `capture(layer_id, topk_ids, topk_weights)` once per MoE layer per forward,
between `on_forward_begin(batch)` and `on_forward_end(batch)`. Capture is injected at construction: the
disabled case is `NullRecorder`, never a `None` check in model code.

`BatchView` is the part of a forward batch a recorder may read. The engine's ForwardBatch satisfies it
structurally, so r3trace.capture never imports the engine (dependency direction: engine -> capture).

Row ranges. The routing op runs over "the routed batch", whose rows `capture` receives and `route_buffer` hands out
from buffer row `row0` (0, except in a chained speculative launch: its k-th forward writes from k x its row count,
so one device buffer holds every forward's rows until the host reads them). That batch is not always this rank's
tokens: under DP attention with a tensor-parallel MoE the router runs over every DP rank's tokens gathered
(SGLang's FULL scatter mode), and a rank's own tokens are the rows `batch.route_rows` names, in request order. A
recorder reads a request's rows only through that range, never as rows [0, T) by assumption (what SGLang's capturer
gets wrong under DP-attention padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch


class RowRange(NamedTuple):
    """Rows [start, start + length) of a buffer shared by more than this rank's tokens."""

    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


class BatchView(Protocol):
    forward_id: int
    out_cache_loc: torch.Tensor  # [T] KV slot of each new token
    out_cache_loc_cpu: np.ndarray | None  # [T] int64, the same on the host, when the engine has it
    positions: torch.Tensor  # [T]
    request_ids: list[str]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    dp_rank: int

    @property
    def phases(self) -> Sequence[str]:
        """Per request: prefill | decode | verify."""
        ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def route_rows(self) -> RowRange:
        """This rank's num_tokens rows within the routed batch (request order): RowRange(0, num_tokens) in one
        process; DpLayout.route_rows under DP attention."""
        ...


@runtime_checkable
class RouteRecorder(Protocol):
    def on_forward_begin(self, batch: BatchView) -> None: ...

    def route_buffer(self, layer_id: int, num_tokens: int, row0: int = 0) -> torch.Tensor | None:
        """Where the routing op may write the routed batch's topk_ids directly (int32 [N, K], contiguous, from
        buffer row row0), or None: a fused top-k kernel writing there makes capture cost no kernel of its own."""
        ...

    def capture(self, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                row0: int = 0) -> None:
        """topk_ids: [N, K] logical ids of the routed batch in gate-rank order; topk_weights: [N, K] (may be
        None), kept from buffer row row0. N >= batch.num_tokens: the rank's own rows are batch.route_rows of them."""
        ...

    def on_forward_end(self, batch: BatchView) -> None: ...


class NullRecorder:
    """Capture off: every hook is a no-op (no buffer, no copy, no sync)."""

    def on_forward_begin(self, batch: BatchView) -> None:
        return None

    def route_buffer(self, layer_id: int, num_tokens: int, row0: int = 0) -> torch.Tensor | None:
        return None

    def capture(self, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                row0: int = 0) -> None:
        return None

    def on_forward_end(self, batch: BatchView) -> None:
        return None


class ListRecorder:
    """Keeps every captured tensor of the last forward on its device: for tests and replay-check.

    routes[layer_id] = (topk_ids [N, K], topk_weights [N, K]) of the routed batch (own rows: batch.route_rows).
    """

    def __init__(self) -> None:
        self.routes: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.history: list[dict[int, tuple[torch.Tensor, torch.Tensor | None]]] = []

    def on_forward_begin(self, batch: BatchView) -> None:
        self.routes = {}

    def route_buffer(self, layer_id: int, num_tokens: int, row0: int = 0) -> torch.Tensor | None:
        return None

    def capture(self, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                row0: int = 0) -> None:
        self.routes[layer_id] = (
            topk_ids.detach().clone(),
            None if topk_weights is None else topk_weights.detach().clone(),
        )

    def on_forward_end(self, batch: BatchView) -> None:
        self.history.append(self.routes)
