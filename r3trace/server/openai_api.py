"""POST /v1/completions and /v1/chat/completions over the same engine call as /generate.

Routes come back as SGLang returns them: at the response level in `sglext` (the same base64 payload, shape,
dtype, MoE layer ids and start_len as /generate's meta_info); with several choices (a list of prompts) `sglext`
holds choice 0's and `sglext.choices` each choice's, by index. Streams are OpenAI chunks ending with `[DONE]`;
the routes come once, whole, in a chunk with `choices: []` after the last choice chunk. A request's `model` must
be one of the served names (ServerConfig.model_names) or absent; any other is OpenAI's 404 `model_not_found`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from .chat import render_chat
from .errors import ERROR_RESPONSES, ApiError
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    RouteFlags,
)
from .route_stream import merge_route_deltas
from .service import GenerateService

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def route_fields(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The route fields of meta_info (routed_experts*, routed_weights*, moe_layer_ids), or None."""
    ext = {k: v for k, v in meta.items() if k.startswith("routed_") or k == "moe_layer_ids"}
    return ext or None


def sglext(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The response-level `sglext` of finished results, or None when no routes were asked for."""
    per_choice = [route_fields(r["meta_info"]) for r in results]
    if per_choice[0] is None:
        return None
    ext = dict(per_choice[0])
    if len(per_choice) > 1:  # r3trace extension: SGLang's /v1/completions serves one prompt per request
        ext["choices"] = [{"index": i, **(e or {})} for i, e in enumerate(per_choice)]
    return ext


class StreamRoutes:
    """Holds a stream's route rows until the end: SGLang sends them once, whole, in a `choices: []` chunk.
    The engine's chunks carry rows as deltas (routed_experts_offset); they are joined here."""

    def __init__(self) -> None:
        self.meta: dict[str, Any] = {}

    def add(self, meta: dict[str, Any]) -> None:
        self.meta = merge_route_deltas(self.meta, meta)

    def chunk(self, head: dict[str, Any]) -> bytes | None:
        ext = route_fields(self.meta)
        if ext is None:
            return None
        ext.pop("routed_experts_offset", None)
        return sse({**head, "choices": [], "sglext": ext})


def finish_reason(meta: dict[str, Any]) -> str | None:
    f = meta.get("finish_reason")
    return None if f is None else str(f.get("type"))


def check_served(req: RouteFlags) -> None:
    """The OpenAI fields a request may carry but r3trace cannot serve: a 400 naming each and saying why."""
    if req.n != 1:
        raise ApiError(400, f"n: {req.n}: one choice per request is served (n > 1 is not implemented)", "n")
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise ApiError(400, f"response_format: type {fmt.get('type')!r}: only \"text\" is served (no constrained "
                            "decoding)", "response_format")
    for name in ("tools", "tool_choice"):
        if getattr(req, name) is not None:
            raise ApiError(400, f"{name}: tool calls are not served (no tool-call parser)", name)


def usage_chunk(head: dict[str, Any], meta: dict[str, Any]) -> bytes:
    """OpenAI's stream_options.include_usage: a last chunk with `choices: []` and the request's usage."""
    p, c = int(meta.get("prompt_tokens", 0)), int(meta.get("completion_tokens", 0))
    return sse({**head, "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c,
                                                 "total_tokens": p + c}})


def stream_tail(routes: StreamRoutes, head: dict[str, Any], usage: bool, meta: dict[str, Any]) -> Iterator[bytes]:
    """The events after a stream's last choice chunk, as SGLang and OpenAI send them: the routes once (choices
    []), the usage chunk when stream_options.include_usage asked for it, then [DONE]."""
    last = routes.chunk(head)
    if last is not None:
        yield last
    if usage:
        yield usage_chunk(head, meta)
    yield SSE_DONE



def wants_usage(req: RouteFlags) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def engine_kwargs(
    req: CompletionRequest | ChatCompletionRequest, prompt: Any, max_tokens: int | None
) -> dict[str, Any]:
    check_served(req)
    sp: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                          "top_k": req.top_k, "seed": req.seed, "stop": req.stop,
                          "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
                          "min_new_tokens": req.min_tokens}  # SGLang's name in OpenAI bodies: min_tokens
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "no_stop_trim",
                 "skip_special_tokens"):
        sp[name] = getattr(req, name)
    kw: dict[str, Any] = {"sampling_params": {k: v for k, v in sp.items() if v is not None}}
    is_ids = isinstance(prompt, list) and (not prompt or not isinstance(prompt[0], str))
    kw["input_ids" if is_ids else "prompt"] = prompt
    kw.update(_route_kwargs(req))
    return kw


def _route_kwargs(req: RouteFlags) -> dict[str, Any]:
    if not req.return_routed_experts:
        return {}
    return {"return_routed_experts": True, "routed_experts_start_len": req.routed_experts_start_len}


def _usage(results: list[dict[str, Any]]) -> dict[str, int]:
    p = sum(int(r["meta_info"]["prompt_tokens"]) for r in results)
    c = sum(int(r["meta_info"]["completion_tokens"]) for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def build_router(service: GenerateService, model_name: str, chat_template: str | None,
                 model_names: frozenset[str] = frozenset()) -> APIRouter:
    """The OpenAI endpoints; `model_names` are the names a request may carry besides `model_name`."""
    router = APIRouter(responses=ERROR_RESPONSES)
    accepted = model_names | {model_name}

    def model_of(req: CompletionRequest | ChatCompletionRequest) -> str:
        """The request's model name (absent: the served one); a name not served is OpenAI's 404."""
        if req.model is None:
            return model_name
        if req.model not in accepted:
            raise ApiError(404, f"model: {req.model!r} is not served here; this server serves {model_name!r} "
                                "(GET /v1/models)", "model", code="model_not_found", type_="invalid_request_error")
        return req.model

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "r3trace"}]}

    @router.post("/v1/completions", response_model=CompletionResponse, response_model_exclude_unset=True,
                 responses={200: {"content": {"text/event-stream": {}}}})
    async def completions(req: CompletionRequest) -> Any:
        model = model_of(req)
        kw = engine_kwargs(req, req.prompt, req.max_tokens)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            chunks = await service.open_stream(kw)

            async def events() -> AsyncIterator[bytes]:
                head = {"id": cid, "object": "text_completion", "created": created, "model": model}
                routes = StreamRoutes()
                meta: dict[str, Any] = {}
                async for ch in chunks:
                    routes.add(ch["meta_info"])
                    meta = ch["meta_info"]
                    choice = {"index": 0, "text": ch["text"], "finish_reason": finish_reason(ch["meta_info"]),
                              "logprobs": None}
                    yield sse({**head, "choices": [choice]})
                for event in stream_tail(routes, head, wants_usage(req), meta):
                    yield event

            return StreamingResponse(events(), media_type="text/event-stream")
        out = await service.generate(kw)
        results = out if isinstance(out, list) else [out]
        choices = [{"index": i, "text": r["text"], "finish_reason": finish_reason(r["meta_info"]),
                    "logprobs": None} for i, r in enumerate(results)]
        body = {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _usage(results)}
        ext = sglext(results)
        return body if ext is None else {**body, "sglext": ext}

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                 response_model_exclude_unset=True,
                 responses={200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(req: ChatCompletionRequest) -> Any:
        model = model_of(req)
        prompt = render_chat(req.messages, chat_template)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        kw = engine_kwargs(req, prompt, max_tokens)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            chunks = await service.open_stream(kw)

            async def events() -> AsyncIterator[bytes]:
                head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
                routes, first = StreamRoutes(), True
                meta: dict[str, Any] = {}
                async for ch in chunks:
                    routes.add(ch["meta_info"])
                    meta = ch["meta_info"]
                    delta = {"role": "assistant", "content": ch["text"]} if first else {"content": ch["text"]}
                    first = False
                    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason(ch["meta_info"])}
                    yield sse({**head, "choices": [choice]})
                for event in stream_tail(routes, head, wants_usage(req), meta):
                    yield event

            return StreamingResponse(events(), media_type="text/event-stream")
        out = await service.generate(kw)
        assert isinstance(out, dict)
        choice = {"index": 0, "message": {"role": "assistant", "content": out["text"]},
                  "finish_reason": finish_reason(out["meta_info"])}
        body = {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": _usage([out])}
        ext = sglext([out])
        return body if ext is None else {**body, "sglext": ext}

    return router
