"""Server-sent events as the endpoints stream them: `data: <json>` events separated by blank lines, the last one
`data: [DONE]` (SGLang's and OpenAI's framing)."""

from __future__ import annotations

import json
from typing import Any

import httpx


def sse_events(response: httpx.Response) -> list[str]:
    """Every event's payload, `[DONE]` last; the body must be nothing but `data:` events ending in `[DONE]`."""
    body = response.read().decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e.removeprefix("data: ") for e in events]


def json_events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON chunks of a stream, `[DONE]` dropped."""
    return [json.loads(e) for e in sse_events(response)[:-1]]


def stream_json(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST `body` with `stream: true` and return its JSON chunks; the status must be 200."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return json_events(r)
