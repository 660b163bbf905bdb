"""POST /v1/completions and /v1/chat/completions over the same engine call as /generate.

A request's choices (n per prompt, prompt-major; r3trace/server/choices.py) are engine requests of their own.
Routes come back in the response-level `sglext` (r3trace/server/openai_stream.py). Streams are OpenAI chunks, each
with its choice's `index`, ending with `[DONE]`. logprobs map the engine's own (r3trace/server/logprobs.py). A
request's `model` must be one of the served names (ServerConfig.model_names) or absent; any other is OpenAI's 404
`model_not_found`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from .chat import render_chat
from .choices import batch_call, choice_requests, merged
from .errors import ERROR_RESPONSES, ApiError
from .logprobs import TokenText, chat_content, completion_block, join_blocks
from .openai_requests import ChatCompletionRequest, CompletionRequest, RouteFlags
from .openai_responses import ChatCompletionResponse, CompletionResponse
from .openai_stream import ChoiceStream, finish_reason, sglext, sse, stream_tail, usage
from .service import GenerateService

Request = CompletionRequest | ChatCompletionRequest


def check_served(req: RouteFlags) -> None:
    """The OpenAI fields a request may carry but r3trace cannot serve: a 400 naming each and saying why."""
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise ApiError(400, f"response_format: type {fmt.get('type')!r}: only \"text\" is served (no constrained "
                            "decoding)", "response_format")
    for name in ("tools", "tool_choice"):
        if getattr(req, name) is not None:
            raise ApiError(400, f"{name}: tool calls are not served (no tool-call parser)", name)
    req.check_extras()
    if isinstance(req, CompletionRequest) and req.best_of is not None and req.best_of > req.n:
        raise ApiError(400, f"best_of: {req.best_of} > n={req.n}: generating best_of candidates and returning the "
                            "n most likely is not served (best_of <= n returns the n choices)", "best_of")


def engine_kwargs(req: Request, prompt: Any, max_tokens: int | None) -> dict[str, Any]:
    """Engine.generate keywords of the request's prompts (one choice each; choice_requests makes n)."""
    check_served(req)
    sp: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                          "top_k": req.top_k, "seed": req.seed, "stop": req.stop, "stop_regex": req.stop_regex,
                          "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
                          "min_new_tokens": req.min_tokens,  # SGLang's name in OpenAI bodies: min_tokens
                          "logit_bias": req.logit_bias}
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "no_stop_trim",
                 "skip_special_tokens"):
        sp[name] = getattr(req, name)
    kw: dict[str, Any] = {"sampling_params": {k: v for k, v in sp.items() if v is not None}}
    is_ids = isinstance(prompt, list) and (not prompt or not isinstance(prompt[0], str))
    kw["input_ids" if is_ids else "prompt"] = prompt
    if req.return_routed_experts:
        kw.update(return_routed_experts=True, routed_experts_start_len=req.routed_experts_start_len)
    if req.dp_rank() is not None:  # the engine checks it against its dp_size
        kw["routed_dp_rank"] = req.dp_rank()
    if wants_prompt_ids(req):
        kw["return_prompt_token_ids"] = True
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        # echo: every prompt token's logprob too (position 0 on); else the output tokens' only
        kw.update(return_logprob=True, top_logprobs_num=req.logprobs, logprob_start_len=0 if req.echo else -1)
    elif isinstance(req, ChatCompletionRequest) and req.logprobs:
        kw.update(return_logprob=True, top_logprobs_num=req.top_logprobs or 0)
    return kw


def wants_prompt_ids(req: Request) -> bool:
    """SGLang's flags: /v1/completions' return_token_ids returns the prompt's ids too (serving_completions.py),
    chat has return_prompt_token_ids for them."""
    if isinstance(req, CompletionRequest):
        return req.return_token_ids
    return req.return_prompt_token_ids


def token_ids(req: Request, result: dict[str, Any], first: bool) -> dict[str, Any]:
    """A choice's (or a stream chunk's) SGLang token-id fields: `token_ids`, the output ids it carries, under
    return_token_ids; `prompt_token_ids` where asked, on a stream's first chunk only."""
    out: dict[str, Any] = {}
    if req.return_token_ids:
        out["token_ids"] = list(result["output_ids"])
    if first and wants_prompt_ids(req):
        out["prompt_token_ids"] = list(result["prompt_token_ids"])
    return out


def prompt_list(prompt: Any) -> list[Any]:
    """One entry per prompt: a string, or a list of token ids."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class Completions:
    """One /v1/completions request's choices: their engine keywords, echoed prompts and logprob blocks."""

    def __init__(self, req: CompletionRequest, tt: TokenText) -> None:
        self.req, self.tt = req, tt.keeping_specials(req.skip_special_tokens is False)
        self.choices = choice_requests(engine_kwargs(req, req.prompt, req.max_tokens), req.n)
        prompts = prompt_list(req.prompt)
        self.echo = [self._prompt_text(prompts[i // req.n]) if req.echo else "" for i in range(len(self.choices))]

    def _prompt_text(self, prompt: Any) -> str:
        if isinstance(prompt, str):
            return prompt
        if self.tt.tokenizer is None:
            raise ApiError(501, "echo: this engine has no tokenizer to decode token-id prompts", "echo")
        return self.tt.tokenizer.decode(list(prompt), skip_special_tokens=self.tt.skip_special_tokens)

    def logprobs(self, i: int, meta: dict[str, Any], first: bool, offset: int) -> tuple[dict[str, Any] | None, int]:
        """Choice i's logprob block for the output tokens in `meta` (with echo, on its first chunk the prompt's
        tokens before them), and the offset after them."""
        if self.req.logprobs is None:
            return None, offset
        block, end = completion_block(self.tt, meta.get("output_token_logprobs", []),
                                      meta.get("output_top_logprobs"), offset)
        if self.req.echo and first:
            prompt, _ = completion_block(self.tt, meta["input_token_logprobs"], meta.get("input_top_logprobs"), 0,
                                         first_is_prompt_start=True)
            block = join_blocks(prompt, block)
        return block, end

    def choice(self, i: int, result: dict[str, Any]) -> dict[str, Any]:
        meta = result["meta_info"]
        lp, _ = self.logprobs(i, meta, True, len(self.echo[i]))
        return {"index": i, "text": self.echo[i] + result["text"], "finish_reason": finish_reason(meta),
                "logprobs": lp, **token_ids(self.req, result, True)}

    def chunk(self, i: int, ch: dict[str, Any], st: ChoiceStream) -> dict[str, Any]:
        if not st.started:
            st.offset = len(self.echo[i])
        lp, st.offset = self.logprobs(i, ch["meta_info"], not st.started, st.offset)
        text = ch["text"] if st.started else self.echo[i] + ch["text"]
        return {"index": i, "text": text, "finish_reason": finish_reason(ch["meta_info"]), "logprobs": lp,
                **token_ids(self.req, ch, not st.started)}


class ChatCompletions:
    def __init__(self, req: ChatCompletionRequest, chat_template: str | None, tt: TokenText) -> None:
        self.req, self.tt = req, tt.keeping_specials(req.skip_special_tokens is False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        options = req.render_options()  # checked with input_ids too, as vLLM checks the body
        prompt = req.input_ids if req.input_ids is not None else \
            render_chat(req.messages, chat_template, req.template_kwargs(), **options)
        self.choices = choice_requests(engine_kwargs(req, prompt, max_tokens), req.n)

    def logprobs(self, meta: dict[str, Any]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return chat_content(self.tt, meta.get("output_token_logprobs", []), meta.get("output_top_logprobs"))

    def choice(self, i: int, result: dict[str, Any]) -> dict[str, Any]:
        meta = result["meta_info"]
        return {"index": i, "message": {"role": "assistant", "content": result["text"]},
                "finish_reason": finish_reason(meta), "logprobs": self.logprobs(meta),
                **token_ids(self.req, result, True)}

    def chunk(self, i: int, ch: dict[str, Any], st: ChoiceStream) -> dict[str, Any]:
        delta = {"content": ch["text"]} if st.started else {"role": "assistant", "content": ch["text"]}
        return {"index": i, "delta": delta, "finish_reason": finish_reason(ch["meta_info"]),
                "logprobs": self.logprobs(ch["meta_info"]), **token_ids(self.req, ch, not st.started)}


def build_router(service: GenerateService, model_name: str, chat_template: str | None,
                 model_names: frozenset[str] = frozenset(), token_text: TokenText | None = None,
                 cache_report: bool = False) -> APIRouter:
    """The OpenAI endpoints; `model_names` are the names a request may carry besides `model_name`; token_text names
    the tokens of logprobs (the engine's tokenizer); cache_report: usage's prompt_tokens_details (SGLang's
    --enable-cache-report)."""
    router = APIRouter(responses=ERROR_RESPONSES)
    accepted = model_names | {model_name}
    tt = token_text or TokenText(None)

    def model_of(req: Request) -> str:
        """The request's model name (absent: the served one); a name not served is OpenAI's 404."""
        if req.model is None:
            return model_name
        if req.model not in accepted:
            raise ApiError(404, f"model: {req.model!r} is not served here; this server serves {model_name!r} "
                                "(GET /v1/models)", "model", code="model_not_found", type_="invalid_request_error")
        return req.model

    async def whole(req: Request, job: Completions | ChatCompletions, head: dict[str, Any]) -> dict[str, Any]:
        out = await service.generate(batch_call(job.choices))
        results = out if isinstance(out, list) else [out]
        body = {**head, "choices": [job.choice(i, r) for i, r in enumerate(results)],
                "usage": usage([r["meta_info"] for r in results], req.n, cache_report)}
        ext = sglext(results, req.return_cached_tokens_details)
        return body if ext is None else {**body, "sglext": ext}

    async def stream(req: Request, job: Completions | ChatCompletions, head: dict[str, Any],
                     make: Callable[[int, dict[str, Any], ChoiceStream], dict[str, Any]]) -> StreamingResponse:
        streams = await service.open_streams(job.choices)
        options = req.stream_options
        with_usage = options is not None and options.include_usage
        continuous = options is not None and options.continuous_usage_stats
        if with_usage:  # OpenAI: every chunk but the usage chunk carries "usage": null
            head = {**head, "usage": None}

        async def events() -> AsyncIterator[bytes]:
            states = [ChoiceStream() for _ in job.choices]
            async for i, ch in merged(streams):
                st = states[i]
                st.add(ch["meta_info"])
                choice = make(i, ch, st)
                st.started = True
                counts = {"usage": usage([st.meta], 1, cache_report)} if continuous else {}  # this choice's
                yield sse({**head, "choices": [choice], **counts})
            for event in stream_tail(states, head, req.n, with_usage, req.return_cached_tokens_details,
                                     cache_report):
                yield event

        return StreamingResponse(events(), media_type="text/event-stream")

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "r3trace"}]}

    @router.post("/v1/completions", response_model=CompletionResponse, response_model_exclude_unset=True,
                 responses={200: {"content": {"text/event-stream": {}}}})
    async def completions(req: CompletionRequest) -> Any:
        model = model_of(req)
        job = Completions(req, tt)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model}
        if req.stream:
            return await stream(req, job, head, job.chunk)
        return await whole(req, job, head)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                 response_model_exclude_unset=True,
                 responses={200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(req: ChatCompletionRequest) -> Any:
        model = model_of(req)
        job = ChatCompletions(req, chat_template, tt)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
        if req.stream:
            return await stream(req, job, {**head, "object": "chat.completion.chunk"}, job.chunk)
        return await whole(req, job, {**head, "object": "chat.completion"})

    return router
