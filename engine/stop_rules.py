"""When a request stops: SGLang's rules, checked after each sampled token."""

from __future__ import annotations

import re
from collections.abc import Set

from r3trace.engine.request import FinishReason, Req
from r3trace.engine.tokenizer import TextTokenizer


def finish_reason(
    req: Req, eos_token_ids: Set[int], tokenizer: TextTokenizer, max_context_len: int
) -> FinishReason | None:
    """SGLang's order: length first, then stop token ids, eos, stop strings, stop regexes, context limit. A matched
    stop string trims req.text before it, unless no_stop_trim (SGLang's detokenizer then keeps it).

    ignore_eos skips the whole token rule, stop_token_ids included, as SGLang's Req._check_token_based_finish returns
    before reading either (schedule_batch.py at sgl-project/sglang fd3907ee4618e96b73ee94d9a836db78efb5d046); vLLM
    stops on stop_token_ids under ignore_eos, SGLang does not. Stop strings and regexes still stop.

    stop_regex (SGLang's Req._check_str_based_finish and DetokenizerManager.trim_matched_stop, read at
    sgl-project/sglang 004c82e07d876f6e4a0ad6e15325706b0f478f1a): the first pattern, in the order given, that
    re.search finds in the output text stops the request with matched = the pattern. The text is trimmed as SGLang
    trims it: before the pattern's own characters where they occur in the text (a pattern without metacharacters),
    otherwise not at all (the match stays in the text). r3trace searches the whole output text; SGLang searches
    the decoded last tokens, as many as the longest match can span, so only a pattern anchored with ^ or a
    lookbehind may find a match here that SGLang's window cannot. The overlapped
    scheduler relies on only the first and last rule being knowable before the token is sampled
    (Scheduler.schedule_ahead leaves those requests out)."""
    p, tok = req.params, req.output_ids[-1]
    if len(req.output_ids) >= p.max_new_tokens:
        return FinishReason("length", length=p.max_new_tokens)
    if not p.ignore_eos and (tok in p.stop_token_ids or tok in eos_token_ids):
        return FinishReason("stop", matched=tok)
    if p.stop or p.stop_regex:
        text = tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
        hits = [(text.find(s), s) for s in p.stop if s in text]
        if hits:
            at, s = min(hits)
            req.text = text if p.no_stop_trim else text[:at]
            return FinishReason("stop", matched=s)
        for pattern in p.stop_regex:
            if re.search(pattern, text) is not None:
                at = text.find(pattern)
                req.text = text if p.no_stop_trim or at == -1 else text[:at]
                return FinishReason("stop", matched=pattern)
    if req.seq_len >= max_context_len:
        return FinishReason("length", length=len(req.output_ids))
    return None


def none_can_finish(req: Req, tokens: list[int], eos_token_ids: Set[int], max_context_len: int) -> bool:
    """True when appending `tokens` to req.output_ids one at a time would make finish_reason return None after every
    one: no rule of finish_reason can fire (length and context limit with room for all of them, no stop token or eos
    among them unless ignore_eos, no stop strings or regexes at all). A speculative verify commits up to d + 1 tokens
    a request a step; this one check replaces a finish_reason call a token in the common case."""
    p, n = req.params, len(tokens)
    if len(req.output_ids) + n >= p.max_new_tokens or req.seq_len + n >= max_context_len or p.stop or p.stop_regex:
        return False
    return p.ignore_eos or not any(t in p.stop_token_ids or t in eos_token_ids for t in tokens)
