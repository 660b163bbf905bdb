"""POST /v1/completions and /v1/chat/completions over the same engine call as /generate.

Routes come back per choice in `sgl_ext` (SGLang's extension block): the same base64 payload, shape,
dtype and MoE layer ids as /generate's meta_info. Streams are OpenAI chunks ending with `[DONE]`; each
chunk's `sgl_ext` holds the route rows that chunk added. A request's `model` must be one of the served
names (ServerConfig.model_names) or absent; any other is OpenAI's 404 `model_not_found`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
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
from .service import GenerateService

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sgl_ext(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The route fields of meta_info (routed_experts*, routed_weights*, moe_layer_ids), or None."""
    ext = {k: v for k, v in meta.items() if k.startswith("routed_") or k == "moe_layer_ids"}
    return ext or None


def finish_reason(meta: dict[str, Any]) -> str | None:
    f = meta.get("finish_reason")
    return None if f is None else str(f.get("type"))


def engine_kwargs(
    req: CompletionRequest | ChatCompletionRequest, prompt: Any, max_tokens: int | None
) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                          "top_k": req.top_k, "seed": req.seed, "stop": req.stop,
                          "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos}
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
                async for ch in chunks:
                    choice = {"index": 0, "text": ch["text"], "finish_reason": finish_reason(ch["meta_info"]),
                              "logprobs": None, "sgl_ext": sgl_ext(ch["meta_info"])}
                    yield sse({"id": cid, "object": "text_completion", "created": created,
                               "model": model, "choices": [choice]})
                yield SSE_DONE

            return StreamingResponse(events(), media_type="text/event-stream")
        out = await service.generate(kw)
        results = out if isinstance(out, list) else [out]
        choices = [{"index": i, "text": r["text"], "finish_reason": finish_reason(r["meta_info"]),
                    "logprobs": None, "sgl_ext": sgl_ext(r["meta_info"])} for i, r in enumerate(results)]
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": choices,
                "usage": _usage(results)}

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
                first = True
                async for ch in chunks:
                    delta = {"role": "assistant", "content": ch["text"]} if first else {"content": ch["text"]}
                    first = False
                    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason(ch["meta_info"]),
                              "sgl_ext": sgl_ext(ch["meta_info"])}
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                               "model": model, "choices": [choice]})
                yield SSE_DONE

            return StreamingResponse(events(), media_type="text/event-stream")
        out = await service.generate(kw)
        assert isinstance(out, dict)
        choice = {"index": 0, "message": {"role": "assistant", "content": out["text"]},
                  "finish_reason": finish_reason(out["meta_info"]), "sgl_ext": sgl_ext(out["meta_info"])}
        return {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice],
                "usage": _usage([out])}

    return router
