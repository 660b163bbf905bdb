"""GenerateService: the bridge from async handlers to the blocking, thread-safe `Engine.generate`.

Each call runs on a worker thread (anyio's pool, at most `max_concurrency` at once) so the event loop
keeps accepting requests; the engine's scheduler thread batches whatever the workers hand it. A stream
pulls one chunk per thread hop. Metrics are updated here, once per finished request.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Any, Protocol, TypeVar

import anyio
import anyio.to_thread

from r3trace.engine.request import InvalidRequestError
from r3trace.trace.schema import TraceStateError

from .errors import ApiError
from .metrics import ServerMetrics

T = TypeVar("T")


class GenerateEngine(Protocol):
    """What the server needs of an engine: r3trace's Engine, or anything shaped like sgl.Engine."""

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


class GenerateService:
    def __init__(self, engine: GenerateEngine, metrics: ServerMetrics, max_concurrency: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_concurrency = max_concurrency
        # Decided once: which generate() keywords this engine accepts (routing replay may be missing).
        self.accepted = frozenset(inspect.signature(engine.generate).parameters)
        self._limiter: anyio.CapacityLimiter | None = None

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on a worker thread, with engine errors mapped to HTTP errors."""
        if self._limiter is None:  # created inside the running loop, as anyio requires
            self._limiter = anyio.CapacityLimiter(self.max_concurrency)
        try:
            return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), limiter=self._limiter)
        except (InvalidRequestError, TraceStateError):  # mapped by the handler that knows the field
            raise
        except NotImplementedError as exc:
            raise ApiError(501, f"not implemented by this engine: {exc}") from exc
        except RuntimeError as exc:
            status = 503 if "shut down" in str(exc) else 500
            raise ApiError(status, f"engine: {exc}") from exc

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        for name in kwargs:
            if name not in self.accepted:
                raise ApiError(501, f"{name}: this engine's generate() does not take it", name)

    def account(self, result: dict[str, Any], finished: bool) -> None:
        meta = result.get("meta_info", {})
        payload = meta.get("routed_experts")
        if payload:
            shape = meta.get("routed_experts_shape") or [0]
            self.metrics.add_capture(payload, int(shape[0]))
        if finished:
            self.metrics.add_tokens(int(meta.get("prompt_tokens", 0)), int(meta.get("completion_tokens", 0)))

    async def generate(self, kwargs: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """A whole result (or a list for a batch)."""
        self.check_kwargs(kwargs)
        self.metrics.enter()
        try:
            out = await self.call(self.engine.generate, **kwargs, stream=False)
        finally:
            self.metrics.leave()
        for r in out if isinstance(out, list) else [out]:
            self.account(r, finished=True)
        return out

    async def open_stream(self, kwargs: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Validates and submits now (errors raise here, before any byte is sent), then yields chunks."""
        [stream] = await self.open_streams([kwargs])
        return stream

    async def open_streams(self, requests: list[dict[str, Any]]) -> list[AsyncIterator[dict[str, Any]]]:
        """One stream per request, every request validated and submitted before this returns; if one is refused,
        those already submitted are closed before the error goes out."""
        its: list[Iterator[dict[str, Any]]] = []
        try:
            for kwargs in requests:
                self.check_kwargs(kwargs)
                its.append(await self.call(self.engine.generate, **kwargs, stream=True))
        except BaseException:
            for it in its:
                await self._close(it)
            raise
        for _ in its:
            self.metrics.enter()
        return [self._chunks(it) for it in its]

    @staticmethod
    async def _close(it: Iterator[dict[str, Any]]) -> None:
        close = getattr(it, "close", None)
        if close is not None:  # the engine aborts the request
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(close)

    async def _chunks(self, it: Iterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        done = object()
        try:
            while True:
                chunk = await self.call(next, it, done)
                if chunk is done:
                    return
                assert isinstance(chunk, dict)
                finished = chunk.get("meta_info", {}).get("finish_reason") is not None
                self.account(chunk, finished)
                yield chunk
        finally:
            self.metrics.leave()
            await self._close(it)  # after the last chunk a no-op; before it, the client went away
