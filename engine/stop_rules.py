"""When a request stops: SGLang's rules, checked after each sampled token."""

from __future__ import annotations

from collections.abc import Set

from r3trace.engine.request import FinishReason, Req
from r3trace.engine.tokenizer import TextTokenizer


def finish_reason(
    req: Req, eos_token_ids: Set[int], tokenizer: TextTokenizer, max_context_len: int
) -> FinishReason | None:
    """SGLang's order: length first, then stop token ids, eos, stop strings, context limit. A matched stop
    string trims req.text before it, unless no_stop_trim (SGLang's detokenizer then keeps it). The overlapped
    scheduler relies on only the first and last rule being knowable before the token is sampled
    (Scheduler.schedule_ahead leaves those requests out)."""
    p, tok = req.params, req.output_ids[-1]
    if len(req.output_ids) >= p.max_new_tokens:
        return FinishReason("length", length=p.max_new_tokens)
    if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_token_ids):
        return FinishReason("stop", matched=tok)
    if p.stop:
        text = tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
        hits = [(text.find(s), s) for s in p.stop if s in text]
        if hits:
            at, s = min(hits)
            req.text = text if p.no_stop_trim else text[:at]
            return FinishReason("stop", matched=s)
    if req.seq_len >= max_context_len:
        return FinishReason("length", length=len(req.output_ids))
    return None
