"""The parts of OpenAI responses that span choices: routes in `sglext`, usage, and a stream's last events.

Routes come back as SGLang returns them: at the response level in `sglext` (the same base64 payload, shape, dtype,
MoE layer ids and start_len as /generate's meta_info), choice 0's; with several choices r3trace adds
`sglext.choices[i]`, each choice's, by index. A stream sends them once, whole, in a chunk with `choices: []` after
the last choice chunk, then the usage chunk (stream_options.include_usage), then `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from .route_stream import merge_route_deltas

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def route_fields(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The route fields of meta_info (routed_experts*, routed_weights*, moe_layer_ids), or None."""
    ext = {k: v for k, v in meta.items() if k.startswith("routed_") or k == "moe_layer_ids"}
    return ext or None


def sglext(results: list[dict[str, Any]], cache_details: bool = False) -> dict[str, Any] | None:
    """The response-level `sglext` of finished results (one per choice), or None when neither routes nor
    (`cache_details`: return_cached_tokens_details) the cache breakdown are there: choice 0's, as SGLang's
    _build_chat_response reads the first result's."""
    cached = results[0]["meta_info"].get("cached_tokens_details") if cache_details else None
    return sglext_of([route_fields(r["meta_info"]) for r in results], cached)


def sglext_of(per_choice: list[dict[str, Any] | None], cached: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The response-level `sglext` from each choice's route fields and the cache breakdown (None: not sent)."""
    if per_choice[0] is None and cached is None:
        return None
    ext = dict(per_choice[0] or {})
    if per_choice[0] is not None and len(per_choice) > 1:
        ext["choices"] = [{"index": i, **(e or {})} for i, e in enumerate(per_choice)]  # r3trace: every choice's
    if cached is not None:  # SGLang's CachedTokensDetails: {device, host} without an L3 storage tier
        ext["cached_tokens_details"] = dict(cached)
    return ext


def usage(metas: list[dict[str, Any]], n: int, cache_report: bool = False) -> dict[str, Any]:
    """OpenAI's usage over choices listed prompt-major, n per prompt: each prompt's tokens once, every choice's
    completion tokens (SGLang's UsageProcessor counts them so). `cache_report` (SGLang's --enable-cache-report):
    `prompt_tokens_details.cached_tokens`, each prompt's cached tokens once, when that sum is > 0."""
    p = sum(int(m.get("prompt_tokens", 0)) for m in metas[::n])
    c = sum(int(m.get("completion_tokens", 0)) for m in metas)
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    cached = sum(int(m.get("cached_tokens", 0)) for m in metas[::n]) if cache_report else 0
    if cached > 0:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def finish_reason(meta: dict[str, Any]) -> str | None:
    f = meta.get("finish_reason")
    return None if f is None else str(f.get("type"))


class ChoiceStream:
    """One choice's state while its stream runs: its route rows (the engine's deltas, joined), its last meta_info,
    whether a chunk was sent, and where its next logprob token starts in its text."""

    def __init__(self, offset: int = 0) -> None:
        self.meta: dict[str, Any] = {}
        self.routes: dict[str, Any] = {}
        self.started = False
        self.offset = offset

    def add(self, meta: dict[str, Any]) -> None:
        self.meta = meta
        self.routes = merge_route_deltas(self.routes, meta)

    def route_fields(self) -> dict[str, Any] | None:
        ext = route_fields(self.routes)
        if ext is not None:
            ext.pop("routed_experts_offset", None)
        return ext


def stream_tail(states: list[ChoiceStream], head: dict[str, Any], n: int, with_usage: bool,
                cache_details: bool = False, cache_report: bool = False) -> Iterator[bytes]:
    """The events after a stream's last choice chunk: the routes and (`cache_details`) the cache breakdown once
    (choices []; the first choice that has one, as SGLang's chat stream picks it), the usage chunk when
    stream_options.include_usage asked for it, then [DONE]. head: id, object, created, model, and `"usage": null`
    when the usage chunk comes."""
    cached = next((s.meta["cached_tokens_details"] for s in states if "cached_tokens_details" in s.meta), None) \
        if cache_details else None
    ext = sglext_of([s.route_fields() for s in states], cached)
    if ext is not None:
        yield sse({**head, "choices": [], "sglext": ext})
    if with_usage:
        yield sse({**head, "choices": [], "usage": usage([s.meta for s in states], n, cache_report)})
    yield SSE_DONE
