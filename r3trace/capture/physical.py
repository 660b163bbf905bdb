"""PhysicalIds: the optional second column of route capture, the physical expert slot of every routed pair.

Shape legend: T tokens, M MoE layers, K top-k, P physical slots, S KV slots.

Under expert parallelism with redundant experts (engine/layers/expert_map.py) the MoE sends each logical route to
one of its expert's replicas: a physical slot in 0..P-1. Logical ids stay what the capturer records, returns and
traces; with EngineConfig.capture_physical_ids the slots are kept too, in a second RouteBuffers that the capturer
moves in lockstep with its first: the same row range (batch.route_rows), the same rows (requests that asked), the
same KV slots, drained together. A request then gets meta_info["routed_experts_physical"] ([rows, L, K] int32,
-1 on dense layers, like routed_experts), and a trace records them as its routes' physical_ids column (the capturer
passes the twin's rows of each drained copy, and the host rows of prefix-cache slots, to the sink).

PhysicalRecorder is the MoE's physical_recorder: MoE.physical_ids hands it [T, K] slots of the rows its router saw;
under EP with attention TP > 1 those are this rank's scattered slice, all-gathered over attention TP first (the
RouteCommunicator's buffer, as for the logical ids), so each DP rank's rows come back in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .buffers import PendingCopy, RouteBuffers
from .recorder import BatchView

if TYPE_CHECKING:
    from .capturer import RoutedExpertsCapturer

Gather = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class PhysicalIds:
    def __init__(self, device_rows: int, host_slots: int, num_moe_layers: int, top_k: int, num_slots: int,
                 device: str) -> None:
        self.buffers = RouteBuffers(device_rows, host_slots, num_moe_layers, top_k, num_slots, device, False)

    def start_copy(self, main: PendingCopy, rows: list[int] | None, batch: BatchView) -> None:
        """The same rows as the logical copy just started (main), into this buffer's own staging."""
        pending = PendingCopy(forward_id=main.forward_id, ts_ns=main.ts_ns, dp_rank=main.dp_rank, n_rows=0,
                              ids=self.buffers.dev_ids, weights=None, slots=batch.out_cache_loc,
                              claim_slots=main.claim_slots)
        self.buffers.start_copy(rows, batch.route_rows, batch.out_cache_loc, pending, batch.out_cache_loc_cpu)

    def read(self, slots: np.ndarray, kept: np.ndarray | None, start: int, end: int) -> np.ndarray:
        """[end - start, M, K] int32: rows kept at a retraction first, then the host rows of the KV slots."""
        n_kept = 0 if kept is None else len(kept)
        parts = [kept[start : min(end, n_kept)]] if kept is not None and start < n_kept else []
        if end > max(start, n_kept):
            parts.append(self.buffers.read(slots[max(start, n_kept) : end]))
        if not parts:
            return np.zeros((0, *self.buffers.host_ids.shape[1:]), np.int32)
        return np.concatenate(parts)


class PhysicalRecorder:
    """A MoE's physical_recorder: only capture() is called (MoE.physical_ids)."""

    def __init__(self, capturer: RoutedExpertsCapturer, gather: Gather | None) -> None:
        self.capturer = capturer
        self.gather = gather

    def on_forward_begin(self, batch: BatchView) -> None:
        pass

    def route_buffer(self, layer_id: int, num_tokens: int, row0: int = 0) -> torch.Tensor | None:
        return None

    def capture(self, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                row0: int = 0) -> None:
        if self.gather is not None:  # [n, K] scattered -> [A * n, K]; the weights' half of the buffer is unused
            topk_ids = self.gather(topk_ids.to(torch.int32), torch.zeros(topk_ids.shape, device=topk_ids.device))[0]
        self.capturer.capture_physical(layer_id, topk_ids, row0)

    def on_forward_end(self, batch: BatchView) -> None:
        pass
