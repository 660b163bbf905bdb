"""BodyLimit: an ASGI middleware that refuses a request body over `max_bytes` before anything parses it.

A declared Content-Length over the limit is refused without reading a byte; a chunked body is read
up to the limit and refused as soon as it passes it, so a client cannot make the server buffer more
than `max_bytes` (8 MiB by default: a 32k-token prompt as JSON ids is ~200 KB) per request.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body

_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Send, status: int, message: str) -> None:
        body = json.dumps(error_body(status, message, "body")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _METHODS_WITH_BODY:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await self._refuse(send, 400, f"content-length: {declared!r} is not an integer")
                return
            if size > self.max_bytes:
                await self._refuse(send, 413, f"body: {size} bytes exceed the limit of {self.max_bytes}")
                return
        chunks: list[bytes] = []
        total = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            part = msg.get("body", b"")
            total += len(part)
            if total > self.max_bytes:
                await self._refuse(send, 413, f"body: more than {self.max_bytes} bytes (the limit) were sent")
                return
            chunks.append(part)
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices for streaming responses

        await self.app(scope, replay, send)
