"""What a caller receives: the SGLang-shaped result dict, whole or as stream deltas.

All meta_info is assembled in `build_result`, so later issues (routed experts, capture ids) add
their fields in one place.
"""

from __future__ import annotations

from typing import Any

from r3trace.engine.request import Req
from r3trace.engine.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"  # a multi-byte character cut at the end of the ids decoded so far


def output_text(req: Req, tokenizer: TextTokenizer) -> str:
    """Decoded output as SGLang's detokenizer returns it: cut before a matched stop string, without a matched
    stop token (the id stays in output_ids), both kept under no_stop_trim; special tokens skipped unless
    skip_special_tokens is false."""
    f, p = req.finish, req.params
    if f is not None and f.type == "stop" and isinstance(f.matched, str):
        return req.text
    ids = req.output_ids
    if f is not None and f.type == "stop" and isinstance(f.matched, int) and not p.no_stop_trim:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)


def _stable_len(req: Req, text: str) -> int:
    """How much of an unfinished request's text cannot change any more: not a trailing cut character,
    not a trailing piece that may grow into a stop string (that text would be trimmed; under no_stop_trim
    nothing is)."""
    end = len(text)
    while end and text[end - 1] == REPLACEMENT:
        end -= 1
    hold = 0
    # a stop regex trims at its own characters when they occur (engine/stop_rules.py): held back as a stop string
    for s in () if req.params.no_stop_trim else (*req.params.stop, *req.params.stop_regex):
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[end - k : end] == s[:k]:
                hold = max(hold, k)
                break
    return end - hold


def build_result(req: Req, tokenizer: TextTokenizer, *, delta: bool) -> dict[str, Any]:
    """The result dict; with delta=True only what was added since the previous call (streaming)."""
    text = output_text(req, tokenizer)
    ids_end = len(req.output_ids)
    text_end = len(text) if req.finished else max(_stable_len(req, text), req.sent_text)
    lp_end = len(req.output_logprobs)
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": req.prompt_len,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": None if req.finish is None else req.finish.to_dict(),
    }
    if req.cached_tokens > 0:
        # SGLang's breakdown by cache tier (scheduler_output_processor_mixin.py _get_cached_tokens_details: without
        # a host tier, {"device": cached_tokens, "host": 0} once any token hit); r3trace's one tier is the device's
        meta["cached_tokens_details"] = {"device": req.cached_tokens, "host": 0}
    if req.spec_verify_ct:  # speculative decoding (SGLang's fields): tokens a verify forward commits, on average
        meta["spec_verify_ct"] = req.spec_verify_ct
        meta["spec_num_proposed_drafts"] = req.spec_num_proposed_drafts
        meta["spec_num_correct_drafts"] = req.spec_num_correct_drafts
        meta["spec_accept_rate"] = req.spec_num_correct_drafts / max(req.spec_num_proposed_drafts, 1)
        meta["spec_accept_length"] = (req.spec_num_correct_drafts + req.spec_verify_ct) / req.spec_verify_ct
    ids_from, text_from, lp_from = (req.sent_ids, req.sent_text, req.sent_logprobs) if delta else (0, 0, 0)
    if req.logprob is not None:
        if not delta or req.sent_logprobs == 0:
            meta["input_token_logprobs"] = list(req.input_logprobs)
            if req.logprob.top_num:
                meta["input_top_logprobs"] = list(req.input_top_logprobs)
        meta["output_token_logprobs"] = req.output_logprobs[lp_from:lp_end]
        if req.logprob.top_num:
            meta["output_top_logprobs"] = req.output_top_logprobs[lp_from:lp_end]
        if req.logprob.token_ids:
            if not delta or req.sent_logprobs == 0:
                meta["input_token_ids_logprobs"] = list(req.input_token_ids_logprobs)
            meta["output_token_ids_logprobs"] = req.output_token_ids_logprobs[lp_from:lp_end]
    out: dict[str, Any] = {
        "text": text[text_from:text_end],
        "output_ids": req.output_ids[ids_from:ids_end],
        "meta_info": meta,
    }
    if req.return_prompt_ids and not (delta and req.sent_prompt_ids):
        out["prompt_token_ids"] = list(req.origin_input_ids)
    if req.finish is not None and req.finish.is_error:
        out["error"] = req.finish.message
    if delta:
        req.sent_prompt_ids = True
        req.sent_ids, req.sent_text, req.sent_logprobs = ids_end, text_end, lp_end
    return out


def error_result(rid: str, message: str, prompt_tokens: int = 0) -> dict[str, Any]:
    """A list entry that failed validation: the others in the list still run."""
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": {"type": "abort", "message": message},
        },
        "error": message,
    }
