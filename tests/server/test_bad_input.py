"""Every bad input is a 4xx whose message names the field, and the next good request still succeeds.

Run: .venv/bin/pytest -q tests/server/test_bad_input.py
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import MAX_BODY

GOOD = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
JSON = {"content-type": "application/json"}

# (case, path, request keyword arguments, status, the field the message must name)
CASES: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("bad json", "/generate", {"content": b'{"text": "hi",', "headers": JSON}, 400, "body"),
    ("not an object", "/generate", {"content": b"[1, 2]", "headers": JSON}, 400, "body"),
    ("unknown field", "/generate", {"json": {"text": "hi", "temprature": 0.5}}, 400, "temprature"),
    ("unknown sampling field", "/generate",
     {"json": {"text": "hi", "sampling_params": {"max_tokens": 3}}}, 400, "sampling_params.max_tokens"),
    ("flag as string", "/generate", {"json": {"text": "hi", "return_routed_experts": "yes"}}, 400,
     "return_routed_experts"),
    ("flag as int", "/generate", {"json": {"text": "hi", "stream": 1}}, 400, "stream"),
    ("negative start_len", "/generate",
     {"json": {"text": "hi", "return_routed_experts": True, "routed_experts_start_len": -1}}, 400,
     "routed_experts_start_len"),
    ("start_len without flag", "/generate", {"json": {"text": "hi", "routed_experts_start_len": 1}}, 400,
     "routed_experts_start_len"),
    ("top_p out of range", "/generate", {"json": {"text": "hi", "sampling_params": {"top_p": 7}}}, 400,
     "sampling_params.top_p"),
    ("negative max_new_tokens", "/generate",
     {"json": {"text": "hi", "sampling_params": {"max_new_tokens": -3}}}, 400,
     "sampling_params.max_new_tokens"),
    ("text and ids", "/generate", {"json": {"text": "hi", "input_ids": [1]}}, 400, "prompt"),
    ("neither text nor ids", "/generate", {"json": {"sampling_params": {}}}, 400, "prompt"),
    ("empty text", "/generate", {"json": {"text": ""}}, 400, "prompt"),
    ("token outside vocab", "/generate", {"json": {"input_ids": [5, 320]}}, 400, "input_ids"),
    ("prompt longer than context", "/generate", {"json": {"input_ids": [5] * 300}}, 400, "input_ids"),
    ("body over limit (declared)", "/generate", {"json": {"text": "x" * (MAX_BODY + 10)}}, 413, "body"),
    ("body over limit (chunked)", "/generate",
     {"content": iter([b'{"text": "', b"x" * (MAX_BODY + 10), b'"}']), "headers": JSON}, 413, "body"),
    ("n differs in a batch", "/generate",
     {"json": {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}}, 400, "sampling_params[1].n"),
    ("openai unknown field", "/v1/completions", {"json": {"prompt": "hi", "best_of": 2}}, 400, "best_of"),
    ("openai n over 128", "/v1/completions", {"json": {"prompt": "hi", "n": 129}}, 400, "n"),
    ("openai negative logprobs", "/v1/completions", {"json": {"prompt": "hi", "logprobs": -1}}, 400, "logprobs"),
    ("openai bad max_tokens", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": "8"}}, 400,
     "max_tokens"),
    ("chat no messages", "/v1/chat/completions", {"json": {"messages": []}}, 400, "messages"),
    ("chat bad role", "/v1/chat/completions",
     {"json": {"messages": [{"role": "robot", "content": "hi"}]}}, 400, "messages[0].role"),
    ("trace outside root", "/start_trace", {"json": {"trace_dir": "../../etc"}}, 400, "trace_dir"),
]


@pytest.mark.parametrize(("case", "path", "kwargs", "status", "field"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_then_good(
    http: httpx.Client, case: str, path: str, kwargs: dict[str, Any], status: int, field: str
) -> None:
    r = http.post(path, **kwargs)
    assert r.status_code == status, (case, r.text)
    err = r.json()["error"]
    assert err["code"] == status
    assert err["param"] == field, err
    assert field.split("[")[0].split(".")[0] in err["message"], err
    ok = http.post("/generate", json=GOOD)
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["output_ids"]) == 2


def test_unknown_path_and_method(http: httpx.Client) -> None:
    assert http.get("/nope").status_code == 404
    r = http.get("/generate")
    assert r.status_code == 405 and "error" in r.json()
    assert http.post("/generate", json=GOOD).status_code == 200


def test_bad_content_length_header(server: Any) -> None:
    """A raw request whose Content-Length is not a number: 400 naming it, and the server keeps serving."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n{}")
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 400"), reply
    with httpx.Client(base_url=server.url) as c:
        assert c.post("/generate", json=GOOD, timeout=60).status_code == 200
