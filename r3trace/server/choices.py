"""Several choices from one HTTP request: SGLang's parallel sampling (`n`) and lists of prompts.

Each choice is an engine request of its own, built here from the request's Engine.generate keywords:
- order prompt-major, as SGLang's tokenizer manager sends them: prompt i's choices are i*n .. i*n + n-1;
- choice j of a seeded prompt samples with seed + j (mod 2**63), vLLM's rule (vllm/v1/engine/parallel_sampling.py
  gives child j `seed + index`): the n choices differ, and choice j equals a lone request with seed + j. SGLang
  copies one seed to every choice, so its seeded choices are n copies of one text; choice 0 is that text;
- choice j of a request with rid R is the engine request R.j (trace rows and ingest name choices `<id>.<index>`).

Whole results come from one engine call with every choice in a list (they are scheduled together); streams open
one engine stream per choice and merge their chunks as they arrive (`merged`), each tagged with its index.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anyio

from .errors import ApiError

PROMPT_KEYS = ("prompt", "input_ids")
SEED_KEYS = ("seed", "sampling_seed")  # sampling_seed: SGLang's name for seed
SEED_SPACE = 2**63  # the engine's seeds are 0 <= seed < 2**63


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice j of a request seeded with `seed`."""
    return (seed + j) % SEED_SPACE


def _prompts(kw: dict[str, Any]) -> tuple[str, list[Any], bool]:
    """(the prompt keyword, one prompt per request, whether the call is a single request)."""
    key = "prompt" if kw.get("prompt") is not None else "input_ids"
    value = kw.get(key)
    single = not isinstance(value, list) if key == "prompt" else not (value and isinstance(value[0], list))
    return key, [value] if single else list(value or ()), single


def choice_requests(kw: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """One single-request keyword dict per choice, prompt-major. A keyword holding a list in a call with several
    prompts is per prompt (as Engine.generate reads it); anything else is shared by every choice."""
    key, prompts, single = _prompts(kw)
    out = []
    for i, prompt in enumerate(prompts):
        base = {k: v for k, v in kw.items() if k not in PROMPT_KEYS}
        if not single:
            for name, value in base.items():
                if isinstance(value, list):
                    if len(value) != len(prompts):
                        raise ApiError(400, f"{name}: a list of {len(value)} values for {len(prompts)} prompts",
                                       name)
                    base[name] = value[i]
        for j in range(n):
            one = {**base, key: prompt}
            if n > 1:
                sp = dict(one.get("sampling_params") or {})
                for seed_key in SEED_KEYS:
                    if sp.get(seed_key) is not None:
                        sp[seed_key] = choice_seed(int(sp[seed_key]), j)
                one["sampling_params"] = sp
                if one.get("rid") is not None:
                    one["rid"] = f"{one['rid']}.{j}"
            out.append(one)
    return out


def batch_call(choices: list[dict[str, Any]]) -> dict[str, Any]:
    """The Engine.generate keywords running every choice in one call (a list in, a list of results out); one
    choice stays a single request (a dict out)."""
    if len(choices) == 1:
        return choices[0]
    key = "prompt" if choices[0].get("prompt") is not None else "input_ids"
    return {name: [c[name] for c in choices] for name in choices[0] if name not in PROMPT_KEYS or name == key}


async def merged(streams: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(choice index, chunk) from every stream as chunks arrive; chunks ready together come in index order.
    Leaving early (the client went away) closes every stream, which aborts its engine request."""
    if len(streams) == 1:  # no tasks for the common case
        async for chunk in streams[0]:
            yield 0, chunk
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: pending[f]):
                i = pending.pop(fut)
                try:
                    chunk = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, chunk
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        # Shielded: a client that went away cancels this task (again at each await under anyio's cancel scopes),
        # and the streams must still be closed for their engine requests to be aborted. The pending reads are let
        # finish (one engine step), not cancelled: a cancelled read leaves its worker thread inside the engine
        # iterator, which then cannot be closed ("generator already executing") and runs on until collected.
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*pending, return_exceptions=True)
            for s in streams:
                close = getattr(s, "aclose", None)
                if close is not None:
                    await close()
