"""Response bodies of the OpenAI endpoints, as pydantic models (they are the OpenAPI spec of /v1/completions and
/v1/chat/completions): OpenAI's fields, and SGLang's response-level `sglext` with r3trace's additions
(docs/compatibility.md, Response fields).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SglExt(BaseModel):
    """SGLang's response-level extension block: the routes (SGLang's `routed_experts`) and r3trace's shape, dtype,
    layer ids and start_len beside them; with several choices, `choices` holds each one's by index."""

    model_config = ConfigDict(extra="allow")
    routed_experts: str | None = None
    routed_experts_shape: list[int] | None = None
    routed_experts_dtype: str | None = None
    moe_layer_ids: list[int] | None = None
    cached_tokens_details: dict[str, int] | None = Field(
        default=None, description="SGLang's, with return_cached_tokens_details: prompt tokens the prefix cache "
        "served, by tier ({\"device\": N, \"host\": 0}; r3trace caches on the device only); absent without a hit")


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(
        default=None, description="with --enable-cache-report (SGLang's flag), when a prompt token hit the cache")


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs, one entry per token (echoed prompt tokens first)."""

    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for the first prompt token (nothing predicts it)")
    top_logprobs: list[dict[str, float] | None] = Field(description="the most likely tokens' logprobs at each "
                                                        "position and the chosen token's, by token text (the best "
                                                        "when two share a text)")
    text_offset: list[int] = Field(description="where each token's text starts in the choice's text")


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = Field(default=None, description="SGLang's: the output's token ids "
                                        "(return_token_ids)")
    prompt_token_ids: list[int] | None = Field(default=None, description="SGLang's: the prompt's token ids "
                                               "(completions: return_token_ids; chat: return_prompt_token_ids)")


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] = Field(description="the token's own bytes (one token may end inside a UTF-8 character)")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = Field(default=None, description="SGLang's: the output's token ids "
                                        "(return_token_ids)")
    prompt_token_ids: list[int] | None = Field(default=None, description="SGLang's: the prompt's token ids "
                                               "(completions: return_token_ids; chat: return_prompt_token_ids)")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    sglext: SglExt | None = None
