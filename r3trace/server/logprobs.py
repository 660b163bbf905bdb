"""The engine's logprob entries in the shapes OpenAI's endpoints return.

The engine returns SGLang's entries: `(logprob, token_id, text)` per token (text None unless asked), and per
position a list of such entries for the most likely tokens, best first (None where the position has none: the
first prompt token). OpenAI's completions want the legacy block (tokens, token_logprobs, top_logprobs,
text_offset); its chat wants `content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]`.

A token's text is the tokenizer's decode of that token alone (special tokens decode to "", as in the choice's text,
and a token that ends inside a UTF-8 character decodes to U+FFFD); its bytes are the exact bytes it adds
(HFTokenizer.token_bytes), so a client joining `bytes` gets the text back where the pieces split characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .errors import ApiError

Entry = Sequence[Any]  # (logprob | None, token_id, text | None)
TopList = Sequence[Entry] | None


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TokenText:
    """Token ids -> their text and bytes, from the engine's tokenizer (decided once, at app construction).
    skip_special_tokens: as the request's, so that the tokens' texts are the pieces of the choice's text."""

    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._bytes = getattr(tokenizer, "token_bytes", None)

    def keeping_specials(self, keep: bool) -> TokenText:
        """This, or the same tokenizer naming special tokens by their text (a request's skip_special_tokens=false)."""
        return TokenText(self.tokenizer, skip_special_tokens=False) if keep else self

    def text(self, entry: Entry) -> str:
        """The token's text: the engine's own when it sent one (an SGLang engine asked for text), else decoded."""
        if len(entry) > 2 and isinstance(entry[2], str):
            return entry[2]
        if self.tokenizer is None:
            raise ApiError(501, "logprobs: this engine has no tokenizer to name the tokens", "logprobs")
        return self.tokenizer.decode([int(entry[1])], skip_special_tokens=self.skip_special_tokens)

    def bytes(self, entry: Entry) -> list[int]:
        own = b"" if self._bytes is None else bytes(self._bytes(int(entry[1])))
        if own or (self._bytes is not None and self.skip_special_tokens):
            return list(own)
        return list(self.text(entry).encode("utf-8"))  # no byte table, or a special token kept in the text

    def with_text(self, entries: Sequence[Entry]) -> list[list[Any]]:
        """SGLang's return_text_in_logprobs: each entry's third element set to its token's text."""
        return [[e[0], e[1], self.text(e)] for e in entries]


def _top_dict(tt: TokenText, top: TopList, chosen: Entry) -> dict[str, float]:
    """The most likely tokens by text, best first, then the chosen token where they lack it: OpenAI's legacy
    `top_logprobs` ("the API will always return the logprob of the sampled token, so there may be up to
    logprobs+1 elements"). Two ids with one text keep the better logprob."""
    out: dict[str, float] = {}
    for e in (*(top or ()), chosen):
        out.setdefault(tt.text(e), float(e[0]))
    return out


def completion_block(tt: TokenText, entries: Sequence[Entry], tops: Sequence[TopList] | None, offset: int,
                     first_is_prompt_start: bool = False) -> tuple[dict[str, list[Any]], int]:
    """OpenAI's legacy logprobs of `entries`, the first token's text starting at character `offset` of the choice's
    text: (block, the offset after the last token). tops: the engine's top lists (None when top_logprobs_num was
    0: each position then lists the chosen token only). first_is_prompt_start: entries[0] is the first prompt
    token, whose top_logprobs is null (nothing predicts it), as OpenAI and SGLang send it."""
    block: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, e in enumerate(entries):
        text = tt.text(e)
        block["tokens"].append(text)
        block["token_logprobs"].append(None if e[0] is None else float(e[0]))
        unpredicted = first_is_prompt_start and i == 0
        block["top_logprobs"].append(None if unpredicted else _top_dict(tt, tops[i] if tops else None, e))
        block["text_offset"].append(offset)
        offset += len(text)
    return block, offset


def join_blocks(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {k: a[k] + b[k] for k in a}


def chat_content(tt: TokenText, entries: Sequence[Entry], tops: Sequence[TopList] | None) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {"content": one entry per output token}."""
    content = []
    for i, e in enumerate(entries):
        top = [{"token": tt.text(t), "logprob": float(t[0]), "bytes": tt.bytes(t)} for t in (tops[i] or ())] \
            if tops else []
        content.append({"token": tt.text(e), "logprob": float(e[0]), "bytes": tt.bytes(e), "top_logprobs": top})
    return {"content": content}


LOGPROB_LISTS = ("input_token_logprobs", "output_token_logprobs")  # one entry per token
# per token: a list of entries, or None (top_logprobs_num's, token_ids_logprob's)
TOP_LISTS = ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")


def with_token_texts(tt: TokenText, result: dict[str, Any]) -> dict[str, Any]:
    """A /generate result (or stream chunk) with SGLang's return_text_in_logprobs applied to its meta_info."""
    meta = dict(result["meta_info"])
    for key in LOGPROB_LISTS:
        if key in meta:
            meta[key] = tt.with_text(meta[key])
    for key in TOP_LISTS:
        if key in meta:
            meta[key] = [None if top is None else tt.with_text(top) for top in meta[key]]
    return {**result, "meta_info": meta}
