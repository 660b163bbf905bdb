"""HostStaging: small host arrays to the device through a ring of pinned buffers, never waiting on the GPU.

Under the overlapped scheduler the host builds step i+1 while the GPU still runs step i, so a host->device copy
is queued behind ~2.4 ms of kernels (batch 64, the 2.5B model on the H200). Two things can go wrong with the
obvious `torch.from_numpy(a).to(device, non_blocking=True)`: from pageable memory the driver may stage the copy
synchronously with the stream (the host then waits for step i, and the overlap is gone), and a pinned buffer
rewritten by the host before the queued copy ran would send the wrong step's values. So each copy goes from its
own pinned buffer, and a buffer is reused only after the event recorded behind its copy has passed. The ring
is sized so a buffer comes back at least two steps later (the runner: 10 buffers for up to 5 copies a step, the
batch's packed fields, the req_to_token writes, a replay plan's two and the input-logprob rows), after the host
already waited for a later step's results: the event check never blocks in steady state.
Buffers hold bytes, so any dtype travels (int64 fields, the sampler's float32 temperatures, bool masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class _Buffer:
    host: torch.Tensor  # [capacity] uint8, pinned
    event: torch.cuda.Event | None = None  # recorded after the copy that reads `host`


class HostStaging:
    def __init__(self, device: torch.device | str, num_buffers: int = 8, capacity: int = 32768) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self._ring = [_Buffer(self._alloc(capacity)) for _ in range(num_buffers)] if self.on_cuda else []
        self._next = 0

    @staticmethod
    def _alloc(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def to_device(self, values: np.ndarray) -> torch.Tensor:
        """values: [n] host array -> a new [n] device tensor of the same dtype, copied asynchronously."""
        src = np.ascontiguousarray(values).reshape(-1)
        if not self.on_cuda:
            return torch.from_numpy(src).to(self.device)
        raw = src.view(np.uint8)
        buf = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        if buf.event is not None:
            buf.event.synchronize()  # its previous copy has run (see the module docstring: never waits in steady state)
        n = len(raw)
        if buf.host.numel() < n:
            buf.host = self._alloc(max(n, 2 * buf.host.numel()))
        buf.host[:n].numpy()[:] = raw
        out = buf.host[:n].to(self.device, non_blocking=True).view(torch.from_numpy(src[:0]).dtype)
        buf.event = torch.cuda.Event()
        buf.event.record()
        return out
