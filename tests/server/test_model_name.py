"""The OpenAI endpoints serve one model: a request's `model` must be the served name or one of its aliases (the
checkpoint's path as given, resolved, its folder name), else OpenAI's 404 `model_not_found`, streaming or not.

Run: .venv/bin/pytest -q tests/server/test_model_name.py
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from r3trace.engine import Engine
from r3trace.server import ServerConfig, create_app
from tests.server.live_server import LiveServer

SERVED = "tiny-served"


@pytest.fixture(scope="module")
def client(engine: Engine, tiny_model: Path) -> Iterator[httpx.Client]:
    aliases = ("../given/path", str(tiny_model), tiny_model.name)  # what `r3trace serve` adds (commands/serve.py)
    cfg = ServerConfig(model_name=SERVED, model_aliases=aliases)
    with LiveServer(create_app(engine, cfg)) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        yield http


def not_found(model: str) -> dict[str, object]:
    return {"error": {"message": f"model: {model!r} is not served here; this server serves {SERVED!r} "
                                 "(GET /v1/models)",
                      "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


def test_models_lists_the_served_name(client: httpx.Client) -> None:
    assert client.get("/v1/models").json() == {
        "object": "list", "data": [{"id": SERVED, "object": "model", "owned_by": "r3trace"}]}


def test_served_name_aliases_and_absent_model_are_accepted(client: httpx.Client, tiny_model: Path) -> None:
    for model in (SERVED, "../given/path", str(tiny_model), tiny_model.name, None):
        body = {"prompt": [5, 6], "max_tokens": 1, **({} if model is None else {"model": model})}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, (model, r.text)
        assert r.json()["model"] == (model or SERVED)
    hi = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"model": tiny_model.name, "messages": hi, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == tiny_model.name


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}),
])
@pytest.mark.parametrize("model", ["gpt-4o", "tiny", SERVED.upper(), ""])
def test_any_other_model_is_404_model_not_found(client: httpx.Client, path: str, body: dict[str, object],
                                                model: str) -> None:
    r = client.post(path, json={**body, "model": model})
    assert r.status_code == 404 and r.headers["content-type"] == "application/json", r.text
    assert json.loads(r.text) == not_found(model)


def test_generate_ignores_openai_model_names(client: httpx.Client) -> None:
    """SGLang's /generate has no `model` field: it is refused as unknown there, as before (400, not 404)."""
    r = client.post("/generate", json={"input_ids": [1, 2], "model": "gpt-4o"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
