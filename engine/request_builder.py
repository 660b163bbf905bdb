"""From `generate()` arguments to validated Reqs, on the caller's thread: tokens, sampling and logprob options
(RequestBuilder.build), then what the request asks of routing: capture options, replay routes and a DP rank
pin (RequestBuilder.attach_routes, into Req.capture, Req.replay and Req.routed_dp_rank).

Every check that can fail for one request happens here, before the scheduler sees it, and raises
InvalidRequestError naming the field, the value and the limit. In a list only that entry fails.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from r3trace.engine.launch.controller import check_routed_dp_rank
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.replay import computed_rows, replay_routes
from r3trace.engine.request import InvalidRequestError, LogprobRequest, Req, SamplingParams
from r3trace.engine.route_options import CaptureRequest
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


@dataclass(frozen=True)
class RouteArgs:
    """generate()'s routing arguments as given: each one value for every request, or a list of one per request
    (routed_experts: a list of per-request routes when there are several requests)."""

    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    return_routed_weights: Any = False
    routed_experts: Any = None
    tag: Any = None
    routed_experts_replay_start_len: Any = None
    routed_dp_rank: Any = None


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
        self, cfg: ModelConfig, max_context_len: int, pool_tokens: int, tokenizer: TextTokenizer, *,
        capture_weights: bool = False, dp_size: int = 1, custom_recorder: bool = False, custom_hooks: bool = False,
    ) -> None:
        """capture_weights: EngineConfig.capture_weights. custom_recorder / custom_hooks: the engine was given its
        own RouteRecorder / RequestHooks, so it cannot return routes, and a replay bypasses the prefix cache."""
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size
        self.max_context_len = max_context_len
        self.pool_tokens = pool_tokens
        self.tokenizer = tokenizer
        self.capture_weights = capture_weights
        self.dp_size = dp_size
        self.custom_recorder = custom_recorder
        self.custom_hooks = custom_hooks

    def build(self, e: RequestEntry, rid: str, stream: bool, sampler: Sampler) -> Req:
        ids, field = self._token_ids(e)
        params = SamplingParams.from_dict(_as_dict(e.sampling_params))
        vocab = self.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                msg = f"{t} outside the vocabulary 0..{vocab - 1}"
                raise InvalidRequestError("sampling_params.stop_token_ids", msg)
        for t, _ in params.logit_bias:
            if t >= vocab:  # SGLang's SamplingParams.verify: keys in [0, vocab_size - 1]
                msg = f"token {t} outside the vocabulary 0..{vocab - 1}"
                raise InvalidRequestError("sampling_params.logit_bias", msg)
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


    def attach_listed_ids(self, req: Req, value: Any, i: int, n: int) -> None:
        """Request i of n's token_ids_logprob (SGLang's GenerateReqInput field): one id list for every request, or
        a list of one list (or None) per request. Without return_logprob it is ignored, as SGLang fills the
        logprob fields of meta_info only then."""
        if value is None:
            return
        if isinstance(value, list) and value and (value[0] is None or isinstance(value[0], list)):
            if len(value) != n:
                raise InvalidRequestError("token_ids_logprob", f"a list of {len(value)} id lists for {n} requests")
            value = value[i]
            if value is None:
                return
        if not isinstance(value, list) or not all(_is_id(t) for t in value):
            raise InvalidRequestError("token_ids_logprob", f"{value!r} must be a list of token ids")
        for t in value:
            if not 0 <= t < self.vocab_size:
                msg = f"{t} outside the vocabulary 0..{self.vocab_size - 1}"
                raise InvalidRequestError("token_ids_logprob", msg)
        if req.logprob is not None and value:
            req.logprob.token_ids = tuple(value)

    def attach_routes(self, req: Req, i: int, n: int, args: RouteArgs) -> None:
        """Request i of n: its capture options, replay routes and DP rank pin into req (raises for it only)."""

        def pick(name: str, value: Any) -> Any:
            if not isinstance(value, list):
                return value
            if len(value) != n:
                raise InvalidRequestError(name, f"a list of {len(value)} values for {n} request(s)")
            return value[i]

        want = pick("return_routed_experts", args.return_routed_experts)
        start = pick("routed_experts_start_len", args.routed_experts_start_len)
        weights = pick("return_routed_weights", args.return_routed_weights)
        tag = pick("tag", args.tag)
        replay_start = pick("routed_experts_replay_start_len", args.routed_experts_replay_start_len)
        # A list of per-request routes when n > 1; one request's routes may themselves be an array.
        forced = args.routed_experts
        forced = forced[i] if n > 1 and isinstance(forced, list) else forced
        for name, value in (("return_routed_experts", want), ("return_routed_weights", weights)):
            if not isinstance(value, bool):
                raise InvalidRequestError(name, f"{value!r} must be true or false")
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise InvalidRequestError("routed_experts_start_len", f"{start!r} must be an integer >= 0")
        if start > req.prompt_len:  # SGLang's scheduler words this error so; its clients match on the phrase
            msg = f"{start} is higher than the number of input tokens {req.prompt_len}; use a smaller " \
                  "routed_experts_start_len"
            raise InvalidRequestError("routed_experts_start_len", msg)
        if (want or weights or forced is not None) and self.custom_recorder:
            raise InvalidRequestError("return_routed_experts", "this engine was built with a custom recorder")
        if weights and not self.capture_weights:
            raise InvalidRequestError("return_routed_weights", "start the engine with capture_weights=True")
        if tag is not None and not isinstance(tag, str):
            raise InvalidRequestError("tag", f"{tag!r} must be a string")
        req.capture = CaptureRequest(
            want=want or weights, start_len=start, weights=weights, tag=tag, arrival_ns=time.time_ns()
        )
        if replay_start is not None and forced is None:
            raise InvalidRequestError(
                "routed_experts_replay_start_len", f"{replay_start!r} given without routed_experts to replay"
            )
        if forced is not None:
            rows = computed_rows(req.prompt_len, req.params.max_new_tokens, self.max_context_len)
            req.replay = replay_routes(forced, replay_start, self.cfg, rows)
            # A prefix-cache hit is reused only where the route hooks find it exact (docs/replay.md); hooks
            # supplied by the caller cannot tell, so there the replay bypasses the cache both ways.
            req.use_prefix_cache = not self.custom_hooks
        req.routed_dp_rank = check_routed_dp_rank(pick("routed_dp_rank", args.routed_dp_rank), self.dp_size)


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def pick_flag(name: str, value: Any, i: int, n: int) -> bool:
    """Request i of n's share of a boolean generate() argument: one for every request, or a list of one each."""
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequestError(name, f"a list of {len(value)} values for {n} request(s)")
        value = value[i]
    if not isinstance(value, bool):
        raise InvalidRequestError(name, f"{value!r} must be true or false")
    return value


def _as_dict(raw: Any) -> dict[str, Any] | None:
    if raw is None or isinstance(raw, dict):
        return raw
    raise InvalidRequestError("sampling_params", f"must be a dict, got {type(raw).__name__}")
