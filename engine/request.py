"""A request's inputs (SamplingParams, validated once) and its state while the scheduler runs it (Req)."""

from __future__ import annotations

import math
import re
from dataclasses import InitVar, dataclass, field, fields
from typing import Any, Literal

import torch

from .route_options import CaptureRequest, ReplayRoutes

FinishType = Literal["length", "stop", "abort"]
LogprobEntry = tuple[float | None, int, None]  # (logprob, token_id, None) as SGLang returns them
# As SGLang: a temperature this small is greedy in all but name, and logits / T could overflow to inf.
GREEDY_TEMPERATURE = 1e-6
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range of a logit_bias value: -100 bans a token, +100 all but forces it


class InvalidRequestError(ValueError):
    """One request is malformed; the message names the field, the value and the limit."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1 means the whole vocabulary
    top_p: float = 1.0
    seed: int | None = None  # a seeded request owns a torch.Generator: same tokens in any batch
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # SGLang's stop_regex: stop once re.search finds one in the output text (engine/stop_rules.py)
    stop_regex: tuple[str, ...] = ()
    ignore_eos: bool = False
    # SGLang's logits processing (engine/penalties.py): on the logits before temperature, greedy rows included
    min_p: float = 0.0  # drop tokens whose probability is below min_p * the top token's
    frequency_penalty: float = 0.0  # logit -= frequency_penalty * times the token was output
    presence_penalty: float = 0.0  # logit -= presence_penalty once the token was output
    repetition_penalty: float = 1.0  # an output token's logit / penalty when > 0, * penalty otherwise
    min_new_tokens: int = 0  # stop_token_ids and EOS cannot be sampled before this many output tokens
    # OpenAI's and SGLang's logit_bias, as (token id, bias) pairs sorted by id: added to the logits after the
    # penalties (SGLang's apply_logits_bias order); the request builder checks the ids against the vocabulary
    logit_bias: tuple[tuple[int, float], ...] = ()
    # SGLang's detokenization (engine/result.py, engine/stop_rules.py)
    skip_special_tokens: bool = True  # false: special tokens are kept in the text
    spaces_between_special_tokens: bool = True  # a slow tokenizer's option: tokenizer.json ignores it, as in HF
    no_stop_trim: bool = False  # true: a matched stop string or stop token is kept in the text
    # SGLang's name for the per-request seed: folded into `seed` (not a field of its own); both may be given
    # only with the same value
    sampling_seed: InitVar[int | None] = None

    def __post_init__(self, sampling_seed: int | None) -> None:
        def bad(name: str, limit: str) -> InvalidRequestError:
            return InvalidRequestError(f"sampling_params.{name}", f"{getattr(self, name)!r} {limit}")

        if sampling_seed is not None:
            if not _is_int(sampling_seed) or not 0 <= sampling_seed < 2**63:
                raise InvalidRequestError(
                    "sampling_params.sampling_seed", f"{sampling_seed!r} must be null or an integer in [0, 2**63)"
                )
            if self.seed is not None and self.seed != sampling_seed:
                raise InvalidRequestError(
                    "sampling_params.sampling_seed",
                    f"{sampling_seed!r} differs from seed={self.seed!r}: give one (sampling_seed is SGLang's name for "
                    "seed) or the same value in both",
                )
            object.__setattr__(self, "seed", sampling_seed)  # frozen: the one assignment __post_init__ makes

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be an integer >= 0")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise bad("temperature", "must be a finite number >= 0")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (all tokens) or an integer >= 1")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be null or an integer in [0, 2**63)")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_regex, tuple) or not all(isinstance(s, str) and s for s in self.stop_regex):
            raise bad("stop_regex", "must be a non-empty string or a list of non-empty strings")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise InvalidRequestError("sampling_params.stop_regex", f"{pattern!r} is not a regex: {exc}") from None
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or not all(_is_int(t) and t >= 0 for t in ids):
            raise bad("stop_token_ids", "must be a list of integers >= 0")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        # SGLang's ranges (SamplingParams.verify); a NaN fails every comparison, so it is refused too
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _is_real(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise bad("repetition_penalty", "must be in (0, 2] (1 = no penalty)")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad("min_new_tokens", f"must be an integer in [0, max_new_tokens={self.max_new_tokens}]")
        for token, bias in self.logit_bias:  # OpenAI's range; a NaN fails the comparison
            if not _is_int(token) or token < 0:
                raise InvalidRequestError("sampling_params.logit_bias", f"key {token!r} is not a token id >= 0")
            if not _is_real(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise InvalidRequestError("sampling_params.logit_bias",
                                          f"{bias!r} for token {token} must be in [-100, 100]")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        """SGLang's dict form: `stop` and `stop_regex` may be one string, lists become tuples, null means the default
        (as SGLang's SamplingParams.__post_init__), unknown keys are errors."""
        raw = {k: v for k, v in (raw or {}).items() if v is not None}
        known = {f.name for f in fields(cls)} | {"sampling_seed"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequestError(f"sampling_params.{unknown[0]}", f"unknown; known: {sorted(known)}")
        for key in ("stop", "stop_regex"):
            if isinstance(raw.get(key), str):
                raw[key] = (raw[key],)
        for key in ("stop", "stop_regex", "stop_token_ids"):
            if isinstance(raw.get(key), list):
                raw[key] = tuple(raw[key])
        if "logit_bias" in raw:
            raw["logit_bias"] = _bias_pairs(raw["logit_bias"])
        return cls(**raw)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        """A penalty that reads the request's output counts (engine/penalties.py)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def _bias_pairs(raw: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sent ({"123": -100}: JSON keys are strings, SGLang reads int(key)) -> sorted (id, bias) pairs;
    two keys naming one id ("7", "07") keep the later value, as SGLang's assignment does."""
    if not isinstance(raw, dict):
        raise InvalidRequestError("sampling_params.logit_bias", f"must be an object of token id -> bias, got {raw!r}")
    out: dict[int, float] = {}
    for key, bias in raw.items():
        token = key if _is_int(key) else int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token is None:
            raise InvalidRequestError("sampling_params.logit_bias", f"key {key!r} is not a token id")
        out[token] = bias
    return tuple(sorted(out.items()))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class LogprobRequest:
    start_len: int  # first prompt position whose logprob is returned
    top_num: int  # 0: no top-logprob lists
    # SGLang's token_ids_logprob: at each returned position, the logprobs of these ids, in this order
    token_ids: tuple[int, ...] = ()


@dataclass
class FinishReason:
    type: FinishType
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    is_error: bool = False  # the request failed (bad input, engine error) rather than being aborted

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "length":
            out["length"] = self.length
        elif self.type == "stop":
            out["matched"] = self.matched
        else:
            out["message"] = self.message
        return out


@dataclass(eq=False)
class Req:
    """One request's state. Survives retraction: outputs, logprobs, generator, capture and replay are kept;
    only the KV (pages, kv_len, cached prefix) is dropped, and `fill_ids` is re-prefilled later. The penalties'
    output counts live on the device in its pool row and are rebuilt from `output_ids` at its first sample
    after each (re)admission (engine/penalties.py)."""

    rid: str
    origin_input_ids: list[int]
    params: SamplingParams
    logprob: LogprobRequest | None = None
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    # KV state, reset on retraction
    pages: list[int] = field(default_factory=list)  # KV pages holding positions 0.. in order
    kv_len: int = 0  # positions whose latent is in the pool
    cached_len: int = 0  # of kv_len, positions matched in the prefix cache (shared, locked)
    cache_node: Any = None  # radix node locked while this request uses the prefix
    pool_row: int = -1  # row in req_to_token; -1 while waiting
    cached_tokens: int = 0  # SGLang's meta_info.cached_tokens, summed over (re)admissions
    # Of kv_len, positions in forwards launched but not yet processed (the overlapped scheduler runs one step
    # ahead): their KV and routes are not on the host yet, so the computed positions are kv_len - inflight.
    inflight: int = 0
    # The fill was computed since (re)admission: each further step adds one token. A re-prefill after
    # retraction (prompt + outputs so far) runs with phase "prefill".
    in_decode: bool = False
    num_retractions: int = 0
    # speculative decoding, over the request's life (SGLang's meta_info names): verify forwards, drafts proposed in
    # them, drafts accepted
    spec_verify_ct: int = 0
    spec_num_proposed_drafts: int = 0
    spec_num_correct_drafts: int = 0
    # logprobs; input ones are computed once (not again after a retraction)
    input_logprobs: list[LogprobEntry] = field(default_factory=list)
    input_top_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    input_logprobs_done: bool = False
    output_logprobs: list[LogprobEntry] = field(default_factory=list)
    output_top_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    # token_ids_logprob: per position the listed ids' entries (input: None where input_top_logprobs has None)
    input_token_ids_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    output_token_ids_logprobs: list[list[LogprobEntry]] = field(default_factory=list)
    generator: torch.Generator | None = None
    # streaming offsets: what the caller has already received
    sent_ids: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    text: str = ""  # decoded output, trimmed before a matched stop string
    capture: CaptureRequest | None = None  # routes to return and how; None: none asked
    replay: ReplayRoutes | None = None  # routes to force; None: the gate routes every position
    routed_dp_rank: int | None = None  # the DP rank the front end must place it on; None: the balancer picks
    # SGLang's return_prompt_token_ids: the result carries `prompt_token_ids` (a stream: on its first chunk only)
    return_prompt_ids: bool = False
    sent_prompt_ids: bool = False
    # False: neither reuse nor fill the prefix cache (a replay under hooks that cannot check a hit's routes).
    # A replay under the route hooks keeps it: they reuse only exact hits (RouteCaptureHooks.usable_prefix).
    use_prefix_cache: bool = True

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV must be in the pool before the next token is sampled."""
        return self.origin_input_ids + self.output_ids

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def computed_len(self) -> int:
        """Positions whose forward has been processed: their KV is in the pool and their routes can be read."""
        return self.kv_len - self.inflight

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.logprob is not None and not self.input_logprobs_done

    def reset_kv(self) -> None:
        """Retraction: forget where the KV lived (the caller has freed it); keep everything computed."""
        self.pages = []
        self.kv_len = 0
        self.cached_len = 0
        self.cache_node = None
        self.pool_row = -1
        self.inflight = 0
        self.in_decode = False
        if not self.input_logprobs_done:
            self.reset_input_logprobs()  # a partly computed prompt is recomputed from its start

    def reset_input_logprobs(self) -> None:
        """The first prompt token has no logprob (nothing predicts it): SGLang reports None."""
        self.input_logprobs, self.input_top_logprobs, self.input_token_ids_logprobs = [], [], []
        if self.logprob is not None and self.logprob.start_len == 0:
            self.input_logprobs.append((None, self.origin_input_ids[0], None))
            self.input_top_logprobs.append(None)
            self.input_token_ids_logprobs.append(None)
