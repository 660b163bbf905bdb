"""A spy on the target's capturer around draft forwards: every buffer's bytes before and after each wrapped forward,
and every recorder hook called while one runs. Used by the eager and the graph-replay draft tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

HOOKS = ("on_forward_begin", "route_buffer", "capture", "on_forward_end")  # what routers and the model call


def capture_state(cap: Any) -> list[np.ndarray]:
    """Every buffer of the target's capturer as bytes: device ids and weights, host rows by slot, slot ownership."""
    b = cap.buffers
    parts = [b.dev_ids, b.dev_weights, torch.from_numpy(b.host_ids), torch.from_numpy(b.host_weights)]
    out = [t.contiguous().view(torch.uint8).numpy().copy() for t in parts if t is not None]
    return out + [b.kv_forward.copy(), b.rows_forward.copy(), np.array([len(b.pending)])]


class CaptureSpy:
    """Installs itself on `cap`'s hooks; `wrap(obj, name)` spies on one forward method of obj. After a run,
    `calls` lists the hooks called inside a wrapped forward, `changed` the buffers one changed, `forwards` counts
    the wrapped calls."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap
        self.inside = False
        self.calls: list[str] = []
        self.changed: list[int] = []
        self.forwards = 0
        for hook in HOOKS:
            setattr(cap, hook, self._hook(hook, getattr(cap, hook)))  # the capturer is called through attributes

    def _hook(self, hook: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.inside:
                self.calls.append(hook)
            return real(*args, **kwargs)

        return call

    def wrap(self, obj: Any, name: str) -> None:
        real = getattr(obj, name)

        def spied(*args: Any) -> Any:
            before = capture_state(self.cap)
            self.inside = True
            try:
                return real(*args)
            finally:
                self.inside = False
                self.forwards += 1
                after = capture_state(self.cap)
                self.changed.extend(i for i, (a, b) in enumerate(zip(before, after, strict=True))
                                    if not np.array_equal(a, b))

        setattr(obj, name, spied)
