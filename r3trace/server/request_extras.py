"""The peers' request fields that r3trace does not act on: accepted and ignored where they cannot change the output
here (as SGLang ignores them when the feature is off), refused with a 400 naming the field and why where serving
them would change the output.

The field lists are SGLang's GenerateReqInput (python/sglang/srt/managers/io_struct.py), SamplingParams
(python/sglang/srt/sampling/sampling_params.py) and the OpenAI CompletionRequest / ChatCompletionRequest
(python/sglang/srt/entrypoints/openai/protocol.py); tests/server/test_peer_fields.py names the commits.
docs/compatibility.md has one row per field. A refused field is refused only when given: null, false, "", [] and
{} (and a list of nulls, as SGLang's batch lora_path) are its "not asked" values and pass.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from .errors import ApiError

_CONSTRAINED = "constrained decoding is not served (no grammar backend)"
_TEXT_ONLY = "the model takes text only (no image, video or audio input)"
_NOT_RETURNED = "r3trace does not return it"

# field -> why it is refused when given (the same reason in every body that carries it)
REFUSED: dict[str, str] = {
    "json_schema": _CONSTRAINED, "regex": _CONSTRAINED, "ebnf": _CONSTRAINED, "structural_tag": _CONSTRAINED,
    "lora_path": "LoRA adapters are not served", "lora_id": "LoRA adapters are not served",
    "custom_logit_processor": "custom logit processors are not run",
    "input_embeds": "input embeddings are not served (send text or input_ids)",
    "positional_embed_overrides": "input embeddings are not served (send text or input_ids)",
    **dict.fromkeys(("image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes"), _TEXT_ONLY),
    **dict.fromkeys(("return_hidden_states", "return_sampling_mask", "return_entropy",
                     "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64", "return_bytes",
                     "return_meta_info"), _NOT_RETURNED),
    "return_indexer_topk": "no sparse-attention indexer is served (DeepSeek-V2/V3 attention is dense)",
    "session_params": "sessions (server-side prompt continuation) are not served",
    "require_reasoning": "reasoning control is not served (no reasoning parser)",
    "max_thinking_tokens": "reasoning control is not served (no reasoning parser)",
    "multi_item_delimiter_indices": "multi-item scoring is not served",
    "suffix": "insertion (text after the completion) is not served",
    "audio": "audio output is not served", "functions": "tool calls are not served (no tool-call parser)",
    "function_call": "tool calls are not served (no tool-call parser)",
}


def _given(value: Any) -> bool:
    if isinstance(value, list):
        return any(_given(v) for v in value)
    return value is not None and value is not False and value != "" and value != {}


def refuse_unserved(body: BaseModel, prefix: str = "") -> None:
    """A 400 for the first field of REFUSED that `body` gives, named with `prefix` (e.g. "sampling_params[1].")."""
    for name in type(body).model_fields.keys() & REFUSED.keys():
        value = getattr(body, name)
        if _given(value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ApiError(400, f"{prefix}{name}: {shown}: {REFUSED[name]}", prefix + name)


_ANY = Field(default=None, description="refused when given (r3trace/server/request_extras.py REFUSED says why)")
_IGNORED = "accepted and ignored, as SGLang does when the feature is off"


class SamplingExtras(BaseModel):
    """SGLang SamplingParams fields beside the honoured ones."""

    json_schema: Any = _ANY
    regex: Any = _ANY
    ebnf: Any = _ANY
    structural_tag: Any = _ANY
    custom_params: dict[str, Any] | None = Field(default=None, description=f"{_IGNORED}: read only by a custom "
                                                 "logit processor, and none runs here")
    stream_interval: int | None = Field(default=None, ge=1, description="SGLang's: a /generate stream sends a chunk "
                                        "every stream_interval output tokens (after tokens 1, k + 1, 2k + 1, ...) "
                                        "and the last one; null: every token")


class GenerateExtras(BaseModel):
    """SGLang GenerateReqInput fields beside the prompt, sampling, logprob and route ones."""

    # ignored: bookkeeping, PD disaggregation (r3trace has no prefill/decode split), cache and routing hints
    session_id: str | None = Field(default=None, description=f"{_IGNORED}: an identity, it does not alter the prompt")
    log_metrics: bool = True
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    conversation_id: str | None = None
    routing_key: str | None = None
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    http_worker_ipc: str | None = None
    background: bool = False
    cache_salt: str | list[str] | None = Field(default=None, description=f"{_IGNORED}: one prefix-cache namespace; "
                                               "a cache hit gives the same tokens as a miss")
    kv_router_hint: dict[str, Any] | None = None
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None
    bootstrap_pair_key: str | list[str | None] | None = None
    decode_tp_size: int | list[int | None] | None = None
    disagg_prefill_dp_rank: int | None = None
    # ignored: they configure media input, which is refused when sent (and EPD disaggregation's internals)
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    image_max_dynamic_patch: int | None = None
    video_max_dynamic_patch: int | None = None
    use_audio_in_video: bool = False
    video_config: dict[str, Any] | None = None
    images_config: dict[str, Any] | None = None
    modalities: list[str | None] | None = None
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: dict[str, list[int]] | None = None
    encoder_urls: list[str] | None = None
    data_parallel_rank: int | None = Field(default=None, description="SGLang's deprecated name of routed_dp_rank: "
                                           "used when routed_dp_rank is unset, as SGLang migrates it")
    # refused when given
    input_embeds: Any = _ANY
    positional_embed_overrides: Any = _ANY
    image_data: Any = _ANY
    video_data: Any = _ANY
    audio_data: Any = _ANY
    mm_hashes: Any = _ANY
    mm_content_hashes: Any = _ANY
    return_sampling_mask: Any = _ANY
    return_flat_raw_top_logprobs: Any = _ANY
    return_flat_raw_top_logprobs_b64: Any = _ANY
    return_hidden_states: Any = _ANY
    return_entropy: Any = _ANY
    return_bytes: Any = _ANY
    return_indexer_topk: Any = _ANY
    session_params: Any = _ANY
    lora_path: Any = _ANY
    lora_id: Any = _ANY
    custom_logit_processor: Any = _ANY
    require_reasoning: Any = _ANY
    max_thinking_tokens: Any = _ANY
    multi_item_delimiter_indices: Any = _ANY


class OpenAIExtras(BaseModel):
    """SGLang's extensions of both OpenAI bodies, and OpenAI fields with no effect here."""

    # ignored
    rid: str | list[str] | None = Field(default=None, description=f"{_IGNORED}: r3trace names the choices itself")
    session_id: str | None = None
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    ngram_corpus_id: str | list[str | None] | None = None
    priority: int | None = None
    custom_labels: dict[str, str] | None = None
    custom_params: dict[str, Any] | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    disagg_prefill_dp_rank: int | None = None
    images_config: dict[str, Any] | None = Field(default=None, description="accepted and ignored: images are refused")
    metadata: dict[str, str] | None = Field(default=None, description="OpenAI's: accepted and ignored (tags for "
                                            "stored completions, which r3trace does not store)")
    store: bool | None = Field(default=None, description="OpenAI's: accepted and ignored (nothing is stored)")
    service_tier: str | None = Field(default=None, description="OpenAI's: accepted and ignored (one tier)")
    prediction: dict[str, Any] | None = Field(default=None, description="OpenAI's predicted output: accepted and "
                                              "ignored (it changes latency, never the output)")
    modalities: list[str] | None = Field(default=None, description="OpenAI's output modalities: [\"text\"] only")
    # honoured
    logit_bias: dict[str, float] | None = Field(default=None, description="token id (a string) -> bias in "
                                                "[-100, 100] added to the logits before sampling")
    routed_dp_rank: int | None = Field(default=None, description="SGLang's: run on this DP rank")
    stop_regex: str | list[str] | None = Field(default=None, description="SGLang's: stop once one of these "
                                             "regexes matches the output text (sampling_params.stop_regex)")
    return_token_ids: bool = Field(default=False, description="SGLang's: each choice's `token_ids` (its output "
                                   "ids; a stream chunk: those it adds); on /v1/completions also the prompt's "
                                   "`prompt_token_ids` (a stream: on the choice's first chunk)")
    data_parallel_rank: int | None = Field(default=None, description="SGLang's deprecated name of routed_dp_rank")
    return_cached_tokens_details: bool = Field(default=False, description="SGLang's: the response-level "
                                               "`sglext.cached_tokens_details` ({device, host} prompt tokens the "
                                               "prefix cache served; a stream: in its `choices: []` chunk)")
    # refused when given
    json_schema: Any = _ANY
    regex: Any = _ANY
    ebnf: Any = _ANY
    lora_path: Any = _ANY
    session_params: Any = _ANY
    custom_logit_processor: Any = _ANY
    return_hidden_states: Any = _ANY
    audio: Any = _ANY
    functions: Any = _ANY
    function_call: Any = _ANY

    def check_extras(self) -> None:
        refuse_unserved(self)
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise ApiError(400, f"modalities: {self.modalities!r}: only \"text\" output is served", "modalities")

    def dp_rank(self) -> int | None:
        return self.routed_dp_rank if self.routed_dp_rank is not None else self.data_parallel_rank
