"""RequestHooks: what the scheduler tells an observer of a request's KV (route capture is the one in use).

Every hook runs on the scheduler thread while the request's KV is still valid. NullHooks observes nothing.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from r3trace.engine.request import Req


class RequestHooks(Protocol):
    def on_admit(self, req: Req) -> None:
        """req.cached_len positions came from the prefix cache; req.kv_len == req.cached_len."""

    def on_retract(self, req: Req) -> None:
        """Before the KV is freed; req keeps outputs, capture and replay and is re-prefilled later."""

    def on_finish(self, req: Req) -> None:
        """req.finish is set; before the KV is freed (or handed to the prefix cache)."""

    def on_reject(self, req: Req, start: int, kept: int, slots: np.ndarray) -> None:
        """A verify forward (speculative decoding) computed positions start.. of req: the first `kept` stay, the next
        len(slots) (their KV slots, host) were rejected or fall past a stop. Called before any other hook of the step
        and before those slots are freed; nothing computed at them may reach a caller or a trace."""

    def usable_prefix(self, req: Req, slots: np.ndarray) -> int:
        """Of a prefix-cache match (slots [n] host), how many leading positions req may reuse."""
        ...

    def prefer_pages(self, cached: np.ndarray, own: np.ndarray) -> bool:
        """A finished request computed KV (slots `own`) for tokens the prefix cache holds (slots `cached`):
        True to cache its copy instead (e.g. only its routes are on the host)."""
        ...


class NullHooks:
    def on_admit(self, req: Req) -> None:
        return None

    def on_retract(self, req: Req) -> None:
        return None

    def on_finish(self, req: Req) -> None:
        return None

    def on_reject(self, req: Req, start: int, kept: int, slots: np.ndarray) -> None:
        return None

    def usable_prefix(self, req: Req, slots: np.ndarray) -> int:
        return int(len(slots))

    def prefer_pages(self, cached: np.ndarray, own: np.ndarray) -> bool:
        return False
