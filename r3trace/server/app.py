"""create_app: the FastAPI application over an engine. One request's path: BodyLimit (size, before
parsing) -> pydantic model (types, unknown fields) -> GenerateService (worker thread -> Engine.generate,
which checks values against the model) -> JSON, or server-sent events for a stream.

Endpoints: POST /generate (SGLang), /v1/completions, /v1/chat/completions, /v1/models (OpenAI),
GET /health, /get_model_info, /metrics (Prometheus), /trace_status, POST /start_trace, /stop_trace (the
engine's trace: one at a time, whoever started it, --trace-dir included), SGLang's expert-distribution recorder
(expert_distribution.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from r3trace.trace.schema import TraceSchemaError, TraceStateError

from .body_limit import BodyLimit
from .choices import batch_call, choice_requests, merged
from .config import ServerConfig
from .errors import ERROR_RESPONSES, ApiError, install_handlers
from .expert_distribution import Recorder, build_recorder_router
from .logprobs import TokenText, with_token_texts
from .metrics import ServerMetrics
from .openai_api import build_router
from .openai_stream import SSE_DONE, sse
from .protocol import (
    GenerateRequest,
    GenerateResponse,
    Health,
    StartTraceRequest,
    TraceStatus,
    UpdateExpertPlacementRequest,
)
from .request_extras import refuse_unserved
from .route_stream import CumulativeStream
from .service import GenerateEngine, GenerateService
from .stream_interval import IntervalGate, choice_intervals

_COUNTED = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/health", "/metrics",
                      "/start_trace", "/stop_trace", "/trace_status", "/v1/models", "/get_model_info"})


class RequestCounter:
    """ASGI middleware: counts answered requests by (endpoint, status) into ServerMetrics."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in _COUNTED else "other"

        async def counting_send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                self.metrics.request_done(path, int(msg["status"]))
            await send(msg)

        await self.app(scope, receive, counting_send)


def generate_kwargs(req: GenerateRequest) -> dict[str, Any]:
    """GenerateRequest -> Engine.generate keywords (SGLang's `text` is the engine's `prompt`)."""
    refuse_unserved(req)
    sp = req.sampling_params
    for i, s in enumerate(sp if isinstance(sp, list) else [sp] if sp else []):
        refuse_unserved(s, f"sampling_params[{i}]." if isinstance(sp, list) else "sampling_params.")
    engine_sp = [s.to_engine() for s in sp] if isinstance(sp, list) else (sp.to_engine() if sp else None)
    if req.max_new_tokens is not None:  # SGLang's top-level max_new_tokens: a default for each request's params
        engine_sp = [{"max_new_tokens": req.max_new_tokens, **s} for s in engine_sp] if isinstance(engine_sp, list) \
            else {"max_new_tokens": req.max_new_tokens, **(engine_sp or {})}
    kw: dict[str, Any] = {
        "prompt": req.text, "input_ids": req.input_ids,
        "sampling_params": engine_sp,
        "return_logprob": req.return_logprob, "logprob_start_len": req.logprob_start_len,
        "top_logprobs_num": req.top_logprobs_num,
    }
    if req.rid is not None:
        kw["rid"] = req.rid
    if req.return_prompt_token_ids:
        kw["return_prompt_token_ids"] = True
    if req.token_ids_logprob is not None:
        kw["token_ids_logprob"] = req.token_ids_logprob
    if req.return_routed_experts:
        kw["return_routed_experts"] = True
        kw["routed_experts_start_len"] = req.routed_experts_start_len
    elif req.routed_experts_start_len:
        raise ApiError(400, f"routed_experts_start_len: {req.routed_experts_start_len} given without "
                            "return_routed_experts=true", "routed_experts_start_len")
    if req.routed_experts is not None:
        kw["routed_experts"] = req.routed_experts
    if req.routed_experts_replay_start_len is not None:  # the engine refuses it without routed_experts
        kw["routed_experts_replay_start_len"] = req.routed_experts_replay_start_len
    if req.tag is not None:
        kw["tag"] = req.tag
    # the engine checks it against its dp_size and names the field; data_parallel_rank: SGLang's deprecated name,
    # used only when routed_dp_rank is unset (GenerateReqInput.normalize_batch_and_arguments)
    dp_rank = req.routed_dp_rank if req.routed_dp_rank is not None else req.data_parallel_rank
    if dp_rank is not None:
        kw["routed_dp_rank"] = dp_rank
    return kw


def choices_per_prompt(req: GenerateRequest) -> int:
    """SGLang's parallel sampling: sampling_params.n, which every entry of a list must give alike (as SGLang)."""
    sp = req.sampling_params
    if sp is None:
        return 1
    if not isinstance(sp, list):
        return sp.n or 1
    ns = [s.n or 1 for s in sp]
    for i, n in enumerate(ns):
        if n != ns[0]:
            raise ApiError(400, f"sampling_params[{i}].n: {n} differs from sampling_params[0].n={ns[0]}: one n for "
                                "every prompt of a request", f"sampling_params[{i}].n")
    return ns[0]


def routing_shape(engine: GenerateEngine) -> dict[str, Any]:
    """What a capture client needs to write a trace manifest (SGLang does not report E): from the
    engine's ModelConfig when it has one."""
    mc = getattr(engine, "model_config", None)
    if mc is None:
        return {}
    return {"num_hidden_layers": mc.num_hidden_layers, "moe_layer_ids": list(mc.moe_layer_ids),
            "num_experts": mc.n_routed_experts, "top_k": mc.num_experts_per_tok, "num_groups": mc.n_group,
            "model_type": mc.model_type}


def _trace_path(root: Path, trace_dir: str, field: str = "trace_dir", what: str = "the trace root") -> Path:
    root = root.resolve()
    path = (root / trace_dir).resolve()
    if path != root and root not in path.parents:
        raise ApiError(400, f"{field}: {trace_dir!r} resolves outside {what} {root}", field)
    return path


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    if isinstance(x, (str, int, float, bool, dict, list)) or x is None:
        return x
    return repr(x)


def _trace_status(st: dict[str, Any], detail: dict[str, Any] | None = None) -> TraceStatus:
    run_dir = st.get("run_dir")
    fields = {k: st.get(k) for k in ("run_id", "rows_buffered", "rows_durable", "requests_durable",
                                     "last_flush_age_s", "stalled_s", "last_error")}
    folder = None if run_dir is None else str(Path(run_dir).parent)
    return TraceStatus(tracing=bool(st.get("tracing")), trace_dir=folder, detail=detail, **fields)


def create_app(engine: GenerateEngine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    metrics = ServerMetrics(config.model_name)
    service = GenerateService(engine, metrics, config.max_concurrency)
    token_text = TokenText(getattr(engine, "tokenizer", None))  # names logprob tokens (OpenAI, return_text_...)
    app = FastAPI(title="r3trace", version="0.1.0",
                  description="SGLang- and OpenAI-compatible generation with routed-expert capture.")
    install_handlers(app)

    @app.post("/generate", response_model=GenerateResponse | list[GenerateResponse],
              response_model_exclude_unset=True, responses={
        **ERROR_RESPONSES,
        200: {"content": {"text/event-stream": {}},
              "description": "JSON result(s), or with stream=true SSE chunks then [DONE]"}})
    async def generate(req: GenerateRequest) -> Any:
        """One request, a list, or n choices per prompt (sampling_params.n): a list of results, prompt-major, as
        SGLang returns them; a stream of several carries each chunk's `index` in that list."""
        kw, n = generate_kwargs(req), choices_per_prompt(req)

        def texts(result: dict[str, Any]) -> dict[str, Any]:
            return with_token_texts(token_text, result) if req.return_text_in_logprobs else result

        if not req.stream:
            out = await service.generate(kw if n == 1 else batch_call(choice_requests(kw, n)))
            return [texts(r) for r in out] if isinstance(out, list) else texts(out)
        choices = choice_requests(kw, n)
        streams = await service.open_streams(choices)

        async def events() -> AsyncIterator[bytes]:
            wholes = [None if req.incremental_streaming_output else CumulativeStream() for _ in choices]
            gates = [IntervalGate(k) for k in choice_intervals(req.sampling_params, len(choices), n)]
            async for i, delta in merged(streams):
                chunk, whole = gates[i].add(delta), wholes[i]
                if chunk is None:  # held: stream_interval's next chunk carries it
                    continue
                out = texts(chunk) if whole is None else whole.add(texts(chunk))
                yield sse(out if len(choices) == 1 else {**out, "index": i})
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        return Health(model=config.model_name, in_flight=metrics.in_flight)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": config.model_name, "is_generation": True, **routing_shape(engine)}

    def trace_status() -> dict[str, Any] | None:
        """The engine's trace state (None: this engine cannot record traces)."""
        fn = getattr(engine, "trace_status", None)
        return None if fn is None else fn()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(trace_status()), media_type="text/plain; version=0.0.4")

    @app.get("/trace_status", response_model=TraceStatus)
    async def get_trace_status() -> TraceStatus:
        st = trace_status()
        if st is None:
            raise ApiError(501, "trace_status: this engine cannot record traces")
        return _trace_status(st)

    @app.post("/start_trace", response_model=TraceStatus, responses=ERROR_RESPONSES)
    async def start_trace(req: StartTraceRequest) -> TraceStatus:
        path = _trace_path(config.trace_root, req.trace_dir)
        fn = getattr(engine, "start_trace", None)
        if fn is None:
            raise ApiError(501, "start_trace: this engine cannot record traces")
        st = trace_status() or {}
        if st.get("tracing"):  # the engine's own state: a trace started by --trace-dir counts too
            raise ApiError(409, f"trace_dir: already tracing into {Path(st['run_dir']).parent} (run {st['run_id']}); "
                                "POST /stop_trace first", "trace_dir")
        try:
            result = await service.call(fn, str(path), run_id=req.run_id, **req.writer_options())
        except TraceSchemaError as exc:  # a run id taken, a bad option value: the message names it
            raise ApiError(400, f"start_trace: {exc}") from exc
        except TraceStateError as exc:  # another /start_trace won the race
            raise ApiError(409, f"start_trace: {exc}", "trace_dir") from exc
        return _trace_status(trace_status() or {"tracing": True}, detail={"result": _jsonable(result)})

    @app.post("/stop_trace", response_model=TraceStatus, responses=ERROR_RESPONSES)
    async def stop_trace() -> TraceStatus:
        fn = getattr(engine, "stop_trace", None)
        if fn is None:
            raise ApiError(501, "stop_trace: this engine cannot record traces")
        st = trace_status() or {}  # the run stop_trace is about to close (its folder and id)
        result = await service.call(fn)
        if result is None:
            raise ApiError(409, "stop_trace: no trace is being recorded; POST /start_trace first")
        return _trace_status({"run_dir": st.get("run_dir"), "run_id": result.get("run_id"),
                              "rows_durable": result.get("rows")}, detail={"result": result})

    @app.post("/update_expert_placement", responses=ERROR_RESPONSES)
    async def update_expert_placement(req: UpdateExpertPlacementRequest) -> dict[str, Any]:
        """Rebalance the experts while serving (Engine.update_expert_placement): requests in flight keep running."""
        path = _trace_path(config.placement_root, req.path, "path", "the placement root")
        fn = getattr(engine, "update_expert_placement", None)
        if fn is None:
            raise ApiError(501, "update_expert_placement: this engine cannot place experts")
        if not path.is_file():
            raise ApiError(400, f"path: {req.path!r} is not a file under {config.placement_root.resolve()}", "path")
        try:
            return dict(await service.call(fn, str(path), req.chunk_layers))
        except ValueError as exc:  # ExpertLocationError: the message names what is wrong with the file
            raise ApiError(400, f"path: {exc}", "path") from exc

    @app.get("/expert_placement", responses=ERROR_RESPONSES)
    async def expert_placement() -> dict[str, Any]:
        """The placement the engine runs, as SGLang's --init-expert-location file: save it for `r3trace eplb
        --previous` (its scores kept as is beside a plan's) or a later POST /update_expert_placement."""
        fn, mc = getattr(engine, "expert_placement", None), getattr(engine, "model_config", None)
        if fn is None or mc is None:
            raise ApiError(501, "expert_placement: this engine reports no expert placement")
        import numpy as np

        from r3trace.eplb.placement import PlacementError, from_phy2log, sglang_map

        running = await service.call(fn)
        try:
            table = sglang_map(from_phy2log(np.asarray(running["phy2log"]), mc.n_routed_experts),
                               mc.num_hidden_layers, tuple(running["layer_ids"]))
        except PlacementError as exc:  # a map that gives an expert no slot: an engine fault, not the request's
            raise ApiError(500, f"expert_placement: {exc}") from exc
        return {"physical_to_logical_map": table.tolist()}

    if hasattr(engine, "start_trace"):  # SGLang's recorder endpoints, over the engine's trace
        app.include_router(build_recorder_router(Recorder(engine, service, config.trace_root,
                                                          config.expert_distribution_dir,
                                                          config.expert_distribution_mode)))
    app.include_router(build_router(service, config.model_name, config.chat_template, config.model_names,
                                    token_text, cache_report=config.enable_cache_report))
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)  # outermost: runs before anything parses
    app.state.metrics = metrics
    app.state.service = service
    return app
