"""Request and response bodies of the HTTP server, as pydantic models (they are the OpenAPI spec).

Requests forbid unknown fields and coerce nothing (`strict=True`): `"return_routed_experts": "yes"`
or `"max_tokens": "8"` is a 400 naming the field, not a silent guess. Value ranges that depend on the
model (vocabulary, context length, start_len <= prompt length) are checked by the engine, which names
the field too. Shapes follow SGLang's /generate and the OpenAI completions API.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="forbid", strict=True)


class SamplingParamsBody(BaseModel):
    """SGLang's sampling_params: the engine's SamplingParams, same names, every field passed on; value ranges are
    the engine's (SGLang's SamplingParams.verify), a 400 naming the field and the limit.

    | field                          | r3trace                                                              |
    | max_new_tokens, min_new_tokens | honoured; min_new_tokens bans stop_token_ids and EOS until reached   |
    | temperature, top_k, top_p      | honoured (0 / top_k 1: greedy)                                       |
    | min_p                          | honoured: tokens below min_p * the top token's probability dropped   |
    | frequency_penalty, presence_penalty, repetition_penalty | honoured over the output tokens, greedy too |
    | seed, sampling_seed            | honoured: the request's own generator (sampling_seed: SGLang's name) |
    | stop, stop_token_ids, ignore_eos | honoured                                                           |
    | skip_special_tokens            | honoured: false keeps special tokens in the text                     |
    | spaces_between_special_tokens  | accepted: a slow tokenizer's option; tokenizer.json decoding ignores |
    |                                | it, as transformers' fast tokenizers do under SGLang                 |
    | no_stop_trim                   | honoured: a matched stop string or stop token stays in the text      |
    """

    model_config = _STRICT
    max_new_tokens: int | None = Field(default=None, ge=0)
    min_new_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    sampling_seed: int | None = Field(default=None, ge=0, description="SGLang's name for seed")
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None

    def to_engine(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class GenerateRequest(BaseModel):
    """POST /generate. Exactly one of `text` / `input_ids`; a list of prompts is a batch.

    SGLang GenerateReqInput fields that do not change r3trace's output:
    | field                         | r3trace                                                              |
    | max_new_tokens (top level)    | honoured: fills sampling_params.max_new_tokens where that is unset.   |
    |                               | Differs: GenerateReqInput has no such field, so SGLang drops it      |
    | extra_key, priority           | accepted, ignored (one cache namespace; first come, first served)    |
    | return_text_in_logprobs       | accepted, ignored: logprob entries carry token ids only              |
    | return_hidden_states          | false accepted; true refused (hidden states are not returned)        |
    | custom_logit_processor        | null accepted; a processor is refused (400)                          |
    | lora_path                     | null accepted; a path is refused (400, LoRA adapters are not served) |
    """

    model_config = _STRICT
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0)
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(default=0, ge=0)
    routed_experts: str | None = Field(
        default=None, description="routing replay: base64 int32 [rows, num_hidden_layers, K] to force; without "
        "routed_experts_replay_start_len it must cover every row the request computes (docs/replay.md)"
    )
    routed_experts_replay_start_len: int | None = Field(
        default=None, ge=0, description="r3trace extension, partial replay: routed_experts forces positions "
        "[start, start + rows) and the gate routes the others"
    )
    stream: bool = False
    incremental_streaming_output: bool = Field(
        default=False, description="r3trace extension, per request (SGLang has it only as the server flag "
        "--incremental-streaming-output): each stream chunk carries what that step added (text, output_ids, "
        "output logprobs, and route rows with routed_experts_offset). Default, as SGLang's default: every chunk "
        "the whole output so far, the routes once, whole, on the last chunk"
    )
    tag: str | list[str] | None = Field(
        default=None, description="r3trace extension: a label per request (e.g. its domain), kept in traces"
    )
    routed_dp_rank: int | list[int | None] | None = Field(
        default=None, description="SGLang's field: run the request on this DP rank (0..dp_size-1), not the one the "
        "load balancer picks; a list gives one per request"
    )
    max_new_tokens: int | None = Field(default=None, ge=0)
    extra_key: str | list[str] | None = None
    priority: int | None = None
    return_text_in_logprobs: bool = False
    return_hidden_states: Literal[False] = False
    custom_logit_processor: str | list[str | None] | None = None
    lora_path: str | list[str | None] | None = None


class MetaInfo(BaseModel):
    """meta_info of a result or a stream chunk; route fields present when return_routed_experts was set."""

    model_config = ConfigDict(extra="allow")
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: dict[str, Any] | None = None
    routed_experts: str | None = Field(default=None, description="base64 of little-endian int32 [rows, L, K]")
    routed_experts_shape: list[int] | None = None
    routed_experts_dtype: str | None = None
    moe_layer_ids: list[int] | None = None


class GenerateResponse(BaseModel):
    """One result, or one stream chunk: by default the whole output so far (routes on the last chunk only); with
    incremental_streaming_output what the step added."""

    model_config = ConfigDict(extra="allow")
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    error: str | None = None


class ErrorDetail(BaseModel):
    message: str = Field(description="names the field, the value and the limit")
    type: str
    param: str | None = Field(default=None, description="the offending field, dotted (sampling_params.top_p)")
    code: int | str = Field(description="the HTTP status, or OpenAI's code where it names one (model_not_found)")


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: OpenAI's error envelope (SGLang's /generate errors also sit under `error`)."""

    error: ErrorDetail


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class RouteFlags(BaseModel):
    """Extension fields the OpenAI endpoints accept, as SGLang does, and the OpenAI fields both bodies share.

    | field            | r3trace                                                                      |
    | stream_options   | include_usage honoured: a last chunk with `choices: []` and `usage`          |
    | user             | accepted, ignored (OpenAI's end-user id)                                     |
    | seed             | honoured: the request's own generator                                        |
    | n                | 1 only; n > 1 is a 400 (one choice per request)                              |
    | response_format  | {"type": "text"} accepted; other types are a 400 (no constrained decoding)   |
    | tools, tool_choice | a 400 when given (no tool-call parser)                                     |
    | frequency_penalty, presence_penalty | honoured: sampling_params of the same names                |
    | repetition_penalty, min_p, no_stop_trim, skip_special_tokens | SGLang's extras: honoured, same names |
    | min_tokens         | SGLang's extra: honoured as sampling_params.min_new_tokens                    |
    """

    model_config = _STRICT
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(default=0, ge=0)
    top_k: int | None = None
    seed: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(RouteFlags):
    """POST /v1/completions (logprobs and echo are not implemented and so refused)."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    stop: str | list[str] | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] = Field(description="a string, or OpenAI content parts: text parts are "
                                                "joined with newlines; image parts are a 400")
    name: str | None = None


class ChatCompletionRequest(RouteFlags):
    """POST /v1/chat/completions; the prompt is the model's chat template applied to `messages`."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    stop: str | list[str] | None = None


class SglExt(BaseModel):
    """SGLang's response-level extension block: the routes (SGLang's `routed_experts`) and r3trace's shape, dtype,
    layer ids and start_len beside them; with several choices, `choices` holds each one's by index."""

    model_config = ConfigDict(extra="allow")
    routed_experts: str | None = None
    routed_experts_shape: list[int] | None = None
    routed_experts_dtype: str | None = None
    moe_layer_ids: list[int] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    sglext: SglExt | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    sglext: SglExt | None = None


class UpdateExpertPlacementRequest(BaseModel):
    model_config = _STRICT
    path: str = Field(description="an expert placement under the server's --placement-root: `r3trace eplb --out`'s "
                                  "JSON, or SGLang's expert-location JSON / .pt")
    chunk_layers: int = Field(default=1, ge=1, le=1 << 16, description="MoE layers switched between two steps")


class StartTraceRequest(BaseModel):
    model_config = _STRICT
    trace_dir: str = Field(description="folder under the server's --trace-root (relative or absolute)")
    run_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]{1,128}$",
                               description="the run's id (default: a timestamp and random suffix)")
    flush_interval_s: float | None = Field(
        default=None, gt=0, le=3600,
        description="commit finished requests at least this often (default 1 s): a kill -9 loses at most the "
                    "requests that finished in the last flush_interval_s")
    rows_per_file: int | None = Field(default=None, ge=1024, le=1 << 30,
                                      description="rows of one routes file at most (default 1,048,576)")
    fsync: bool | None = Field(default=None, description="fsync each commit (default true): survives power loss")

    def writer_options(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, include={"flush_interval_s", "rows_per_file", "fsync"})


class TraceStatus(BaseModel):
    """The trace state: while one records, its run and how much of it is durable (WriterStatus's fields)."""

    tracing: bool
    trace_dir: str | None = None
    run_id: str | None = None
    rows_buffered: int | None = None
    rows_durable: int | None = None
    requests_durable: int | None = None
    last_flush_age_s: float | None = None
    last_error: str | None = None
    detail: dict[str, Any] | None = None


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    in_flight: int
