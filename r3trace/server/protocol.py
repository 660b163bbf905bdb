"""Request and response bodies of the HTTP server, as pydantic models (they are the OpenAPI spec); the OpenAI
endpoints' request bodies are in openai_requests.py, their response bodies in openai_responses.py, and the SGLang
fields r3trace accepts without acting on, or refuses, in request_extras.py.

Requests forbid unknown fields and coerce nothing (`strict=True`): `"return_routed_experts": "yes"`
or `"max_tokens": "8"` is a 400 naming the field, not a silent guess. Value ranges that depend on the
model (vocabulary, context length, start_len <= prompt length) are checked by the engine, which names
the field too. Shapes follow SGLang's /generate and the OpenAI completions API.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .request_extras import GenerateExtras, SamplingExtras

STRICT = ConfigDict(extra="forbid", strict=True)


MAX_CHOICES = 128  # OpenAI's limit on n; each choice is an engine request of its own


class SamplingParamsBody(SamplingExtras):
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
    | n                              | parallel sampling (r3trace/server/choices.py): n engine requests per |
    |                                | prompt, results prompt-major; seeded choice j samples with seed + j  |
    | logit_bias                     | honoured: token id -> bias in [-100, 100] added to the logits after  |
    |                                | the penalties (SGLang's order); ids checked against the vocabulary   |
    | custom_params                  | accepted, ignored (no custom logit processor runs)                   |
    | stream_interval                | honoured on /generate streams: a chunk after output tokens 1, k + 1, |
    |                                | 2k + 1, ... and the last (r3trace/server/stream_interval.py)         |
    | json_schema, regex, ebnf, structural_tag | a 400 when given: constrained decoding is not served       |
    | stop_regex                     | honoured: stop once one matches the output text (SGLang's trimming:  |
    |                                | at the pattern's own characters where they occur, else none)         |
    """

    model_config = STRICT
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
    stop_regex: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    sampling_seed: int | None = Field(default=None, ge=0, description="SGLang's name for seed")
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES, description="choices per prompt (SGLang's "
                          "parallel sampling): the results are a list, prompt-major; seeded choice j uses seed + j")
    logit_bias: dict[str, float] | None = Field(default=None, description="token id (a string, as JSON keys are) -> "
                                                "bias in [-100, 100] added to the logits before sampling")

    def to_engine(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude={"n", *SamplingExtras.model_fields})


class GenerateRequest(GenerateExtras):
    """POST /generate. Exactly one of `text` / `input_ids`; a list of prompts is a batch.

    SGLang GenerateReqInput fields beside the prompt, sampling, logprob and route ones (docs/compatibility.md):
    | field                         | r3trace                                                              |
    | max_new_tokens (top level)    | honoured: fills sampling_params.max_new_tokens where that is unset.   |
    |                               | Differs: GenerateReqInput has no such field, so SGLang drops it      |
    | extra_key, priority           | accepted, ignored (one cache namespace; first come, first served)    |
    | return_text_in_logprobs       | honoured: each logprob entry's third element is its token's text     |
    | return_prompt_token_ids       | honoured: top-level `prompt_token_ids` (a stream: its first chunk)   |
    | token_ids_logprob             | honoured with return_logprob: meta_info input_token_ids_logprobs /   |
    |                               | output_token_ids_logprobs, the listed ids' entries per position      |
    | data_parallel_rank            | honoured: SGLang's deprecated name of routed_dp_rank (used when that |
    |                               | is unset, as SGLang migrates it)                                     |
    | GenerateExtras' ignored group | accepted, ignored: bookkeeping, PD-disaggregation bootstrap, cache   |
    |                               | and routing hints, media options (media itself is refused)           |
    | GenerateExtras' refused group | null / false accepted; given, a 400 naming the field and why: lora,  |
    |                               | custom_logit_processor, media and embeddings, return_hidden_states   |
    |                               | and the other returns r3trace lacks, session_params, reasoning knobs |
    """

    model_config = STRICT
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
    stream: bool = Field(default=False, description="server-sent events; with several requests (a list, or "
                         "sampling_params.n > 1) each chunk carries `index`, the request's place in the list")
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
    token_ids_logprob: list[int] | list[list[int] | None] | None = Field(
        default=None, description="SGLang's: with return_logprob, meta_info input_token_ids_logprobs / "
        "output_token_ids_logprobs hold these ids' logprobs at each returned position; a list of lists gives one "
        "per request")
    return_prompt_token_ids: bool = Field(default=False, description="SGLang's: the result's top-level "
                                          "`prompt_token_ids`, the prompt's token ids (a stream: first chunk)")


class MetaInfo(BaseModel):
    """meta_info of a result or a stream chunk; route fields present when return_routed_experts was set."""

    model_config = ConfigDict(extra="allow")
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] | None = Field(
        default=None, description="SGLang's prefix-cache hits by tier, once any prompt token hit: "
        "{\"device\": cached_tokens, \"host\": 0} (r3trace caches on the device only)")
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


class UpdateExpertPlacementRequest(BaseModel):
    model_config = STRICT
    path: str = Field(description="an expert placement under the server's --placement-root: `r3trace eplb --out`'s "
                                  "JSON, or SGLang's expert-location JSON / .pt")
    chunk_layers: int = Field(default=1, ge=1, le=1 << 16, description="MoE layers switched between two steps")


class StartTraceRequest(BaseModel):
    model_config = STRICT
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
    stalled_s: float | None = None
    last_error: str | None = None
    detail: dict[str, Any] | None = None


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    in_flight: int
