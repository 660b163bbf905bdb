"""From `generate()` arguments to validated Reqs, on the caller's thread.

Every check that can fail for one request happens here, before the scheduler sees it, and raises
InvalidRequestError naming the field, the value and the limit. In a list only that entry fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r3trace.engine.request import InvalidRequestError, LogprobRequest, Req, SamplingParams
from r3trace.engine.sampling import Sampler
from r3trace.engine.tokenizer import TextTokenizer


@dataclass(frozen=True)
class RequestEntry:
    """One request's share of the generate() arguments (not validated yet)."""

    prompt: Any
    input_ids: Any
    sampling_params: Any
    return_logprob: Any
    logprob_start_len: Any
    top_logprobs_num: Any
    rid: str | None


def as_list(
    prompt: Any, input_ids: Any, sampling_params: Any, return_logprob: Any, logprob_start_len: Any,
    top_logprobs_num: Any, rid: Any,
) -> tuple[bool, list[RequestEntry]]:
    """(is a single request, one entry per request). Per-request arguments may be lists (one value per
    request) or scalars (shared), as in SGLang."""
    if (prompt is None) == (input_ids is None):
        raise InvalidRequestError("prompt", "give exactly one of prompt or input_ids")
    if prompt is not None:
        single = not isinstance(prompt, list)
        texts: list[Any] = [prompt] if single else list(prompt)
        ids: list[Any] = [None] * len(texts)
    else:
        single = not (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list))
        ids = [input_ids] if single else list(input_ids)
        texts = [None] * len(ids)
    n = len(ids)
    if n == 0:
        raise InvalidRequestError("prompt", "an empty list of requests")

    def per_request(name: str, value: Any, is_list: bool) -> list[Any]:
        if not is_list:
            return [value] * n
        if single or len(value) != n:
            raise InvalidRequestError(name, f"a list of {len(value)} values for {n} request(s)")
        return list(value)

    params = per_request("sampling_params", sampling_params, isinstance(sampling_params, list))
    lps = per_request("return_logprob", return_logprob, isinstance(return_logprob, list))
    starts = per_request("logprob_start_len", logprob_start_len, isinstance(logprob_start_len, list))
    tops = per_request("top_logprobs_num", top_logprobs_num, isinstance(top_logprobs_num, list))
    rids = per_request("rid", rid, isinstance(rid, list))
    if rid is not None and not isinstance(rid, list) and not single:
        raise InvalidRequestError("rid", "one rid for a list of requests; pass a list of rids")
    columns = zip(texts, ids, params, lps, starts, tops, rids, strict=True)
    return single, [RequestEntry(*fields) for fields in columns]


class RequestBuilder:
    def __init__(
        self, vocab_size: int, max_context_len: int, pool_tokens: int, tokenizer: TextTokenizer
    ) -> None:
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.pool_tokens = pool_tokens
        self.tokenizer = tokenizer

    def build(self, e: RequestEntry, rid: str, stream: bool, sampler: Sampler) -> Req:
        ids, field = self._token_ids(e)
        params = SamplingParams.from_dict(_as_dict(e.sampling_params))
        vocab = self.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                msg = f"{t} outside the vocabulary 0..{vocab - 1}"
                raise InvalidRequestError("sampling_params.stop_token_ids", msg)
        logprob = self._logprob(e, len(ids))
        req = Req(rid=rid, origin_input_ids=ids, params=params, logprob=logprob, stream=stream)
        if params.seed is not None:
            req.generator = sampler.request_generator(params.seed)
        req.reset_input_logprobs()
        return req

    def _token_ids(self, e: RequestEntry) -> tuple[list[int], str]:
        if e.input_ids is not None:
            field, ids = "input_ids", e.input_ids
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):  # bool is not a token
                raise InvalidRequestError(field, "must be a list of integer token ids")
        else:
            field = "prompt"
            if not isinstance(e.prompt, str):
                raise InvalidRequestError(field, f"must be a string, got {type(e.prompt).__name__}")
            if not e.prompt:
                raise InvalidRequestError(field, "is empty: at least one token is needed")
            ids = self.tokenizer.encode(e.prompt)
        if not ids:
            raise InvalidRequestError(field, "is empty: at least one token is needed")
        vocab, context = self.vocab_size, self.max_context_len
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                msg = f"token id {t} at index {i} outside the vocabulary 0..{vocab - 1}"
                raise InvalidRequestError("input_ids", msg)
        if len(ids) >= context:
            msg = f"{len(ids)} tokens leave no room to generate in max_context_len={context}"
            raise InvalidRequestError(field, msg)
        if len(ids) > self.pool_tokens:
            raise InvalidRequestError(
                field, f"{len(ids)} tokens do not fit the KV pool of kv_pool_tokens={self.pool_tokens}"
            )
        return list(ids), field

    def _logprob(self, e: RequestEntry, prompt_len: int) -> LogprobRequest | None:
        if not isinstance(e.return_logprob, bool):
            raise InvalidRequestError("return_logprob", f"{e.return_logprob!r} must be true or false")
        if not e.return_logprob:
            return None
        start, top = e.logprob_start_len, e.top_logprobs_num
        if not isinstance(start, int) or isinstance(start, bool):
            raise InvalidRequestError("logprob_start_len", f"{start!r} must be an integer")
        if start == -1:  # SGLang's default: only the last prompt token (output logprobs are separate)
            start = prompt_len - 1
        if not 0 <= start < prompt_len:
            raise InvalidRequestError("logprob_start_len", f"{start} outside 0..{prompt_len - 1} (or -1)")
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= self.vocab_size:
            raise InvalidRequestError("top_logprobs_num", f"{top!r} outside 0..{self.vocab_size}")
        return LogprobRequest(start_len=start, top_num=top)


def _as_dict(raw: Any) -> dict[str, Any] | None:
    if raw is None or isinstance(raw, dict):
        return raw
    raise InvalidRequestError("sampling_params", f"must be a dict, got {type(raw).__name__}")
