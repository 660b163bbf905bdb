"""Request bodies of the OpenAI endpoints (POST /v1/completions, /v1/chat/completions), as pydantic models; the
fields SGLang's OpenAI bodies add beside these, ignored or refused, are in request_extras.py (OpenAIExtras).

Strict as protocol.py's bodies: unknown fields and wrong types are a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from .errors import ApiError
from .protocol import MAX_CHOICES, STRICT
from .request_extras import OpenAIExtras


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = Field(default=False, description="a last chunk with `choices: []` and the usage; every "
                                "other chunk then carries `\"usage\": null`, as OpenAI sends them")
    continuous_usage_stats: bool = Field(default=False, description="SGLang's and vLLM's extension: each choice "
                                         "chunk carries its choice's usage so far")


class RouteFlags(OpenAIExtras):
    """Extension fields the OpenAI endpoints accept, as SGLang does, and the OpenAI fields both bodies share.

    | field            | r3trace                                                                      |
    | stream_options   | include_usage honoured: a last chunk with `choices: []` and `usage`, and     |
    |                  | `"usage": null` on every other chunk (OpenAI's contract);                    |
    |                  | continuous_usage_stats (SGLang): each choice chunk its choice's usage so far |
    | user             | accepted, ignored (OpenAI's end-user id)                                     |
    | seed             | honoured: the request's own generator; choice j of n uses seed + j (vLLM's   |
    |                  | rule; SGLang gives every choice the same seed, so the same text)             |
    | n                | 1..128 honoured: n engine requests per prompt, choices prompt-major          |
    | response_format  | {"type": "text"} accepted; other types are a 400 (no constrained decoding)   |
    | tools, tool_choice | a 400 when given (no tool-call parser)                                     |
    | frequency_penalty, presence_penalty | honoured: sampling_params of the same names                |
    | repetition_penalty, min_p, no_stop_trim, skip_special_tokens | SGLang's extras: honoured, same names |
    | min_tokens         | SGLang's extra: honoured as sampling_params.min_new_tokens                    |
    | logit_bias         | honoured: token id -> bias in [-100, 100] added to the logits (last, after     |
    |                    | the penalties, as SGLang); -100 bans a token, +100 all but forces it          |
    | routed_dp_rank, data_parallel_rank | SGLang's: honoured as /generate's routed_dp_rank                 |
    | the rest of OpenAIExtras | accepted and ignored, or a 400 naming the field and why                 |
    """

    model_config = STRICT
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
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(RouteFlags):
    """POST /v1/completions.

    | field     | r3trace                                                                               |
    | logprobs  | honoured: tokens, token_logprobs, top_logprobs (the `logprobs` most likely and the      |
    |           | chosen token), text_offset                                                             |
    | echo      | honoured: the prompt before each choice's text; with logprobs the prompt's tokens too  |
    |           | (the first one's logprob null)                                                        |
    | best_of   | <= n accepted (SGLang ignores it); > n a 400 (no ranking of candidates)                |
    | suffix    | a 400 when given (insertion is not served)                                             |
    | return_token_ids | SGLang's: honoured, each choice's `token_ids` and `prompt_token_ids` (a stream:   |
    |           | `token_ids` the ids each chunk adds, `prompt_token_ids` on the choice's first chunk)     |
    """

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, description="the most likely tokens listed per position in "
                                   "top_logprobs, plus the chosen one where they lack it (OpenAI's rule)")
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, description="accepted up to n (the n choices are the best_of "
                                "candidates); over n a 400: ranking candidates is not served")
    suffix: str | None = Field(default=None, description="refused when given: insertion is not served")
    max_tokens: int | None = Field(default=16, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    stop: str | list[str] | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] = Field(description="a string, or OpenAI content parts: text parts are "
                                                "joined with newlines; image parts are a 400")
    name: str | None = None


class ChatCompletionRequest(RouteFlags):
    """POST /v1/chat/completions; the prompt is the model's chat template applied to `messages`. logprobs: true
    returns `logprobs.content` per choice, with the `top_logprobs` most likely tokens at each (ignored without
    logprobs, as SGLang; OpenAI refuses that).

    | field                  | r3trace                                                                    |
    | max_completion_tokens  | honoured: OpenAI's newer name of max_tokens, and wins over it (as SGLang)  |
    | chat_template_kwargs   | honoured: passed to the chat template (e.g. {"thinking": true})           |
    | reasoning_effort       | honoured as SGLang does: sets chat_template_kwargs thinking and            |
    |                        | enable_thinking to effort != "none" where those are unset                 |
    | input_ids              | SGLang's: honoured, the prompt's token ids (the template is not applied)  |
    | parallel_tool_calls, separate_reasoning, stream_reasoning, task, max_dynamic_patch, min_dynamic_patch, |
    | use_audio_in_video     | accepted, ignored (no tool or reasoning parser, text-only model)           |
    | return_prompt_token_ids | honoured: each choice's `prompt_token_ids`, the templated prompt's ids  |
    |                        | (SGLang refuses it on a stream; here a stream's first chunk carries them) |
    | return_token_ids       | honoured: each choice's `token_ids` (a stream: each chunk the ids it adds; |
    |                        | SGLang drops or refuses it on chat streams)                              |
    | continue_final_message | honoured (SGLang's): a last assistant message is continued, unclosed: the  |
    |                        | template over the messages before it with the generation prompt, then its  |
    |                        | text; with add_generation_prompt true as well a 400 (vLLM's rule)          |
    | add_generation_prompt  | vLLM's: false renders the messages without the assistant turn's opening    |
    | return_cached_tokens_details | SGLang's: response-level sglext.cached_tokens_details {device, host} |
    | return_meta_info       | a 400 when given                                                           |
    """

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | float | None = None
    input_ids: list[int] | None = None
    parallel_tool_calls: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    task: str | None = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    use_audio_in_video: bool | None = None
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = Field(default=None, description="vLLM's: null or true opens the "
                                               "assistant turn after the messages; false does not")
    return_prompt_token_ids: bool = Field(default=False, description="SGLang's: each choice's `prompt_token_ids`")
    return_meta_info: bool | None = None

    def render_options(self) -> dict[str, bool]:
        """render_chat's add_generation_prompt / continue_final_message; both true is vLLM's 400
        (ChatCompletionRequest.check_generation_prompt, chat_completion/protocol.py at vllm-project/vllm
        002032ee2b18e1f7bd924ec47b62504ba3866063: only when the body sets both, so SGLang's clients, which send
        no add_generation_prompt, pass)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(400, "continue_final_message: cannot set both continue_final_message and "
                                "add_generation_prompt to true", "continue_final_message")
        return {"add_generation_prompt": self.add_generation_prompt is not False,
                "continue_final_message": bool(self.continue_final_message)}

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, with reasoning_effort's thinking / enable_thinking where unset (SGLang's rule)."""
        kw = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            thinking = self.reasoning_effort != "none"
            kw.setdefault("thinking", thinking)
            kw.setdefault("enable_thinking", thinking)
        return kw
