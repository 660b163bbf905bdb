"""capture(): generate over HTTP from any SGLang-compatible /generate with return_routed_experts, and
write what comes back as an r3trace trace (one run) through TraceWriter.

Shape legend: R rows (token positions with routes), L MoE layers, K top-k, E experts.

The shape comes from the response (`routed_experts_shape`, `moe_layer_ids`: r3trace servers) or from
a given Manifest (plain SGLang returns a flat array, and every layer, dense ones as 0). E comes from
the manifest, the `num_experts` argument, or the server's /get_model_info. Rows before
`meta_info.cached_tokens` are recorded with source=prefix_cache; rows at positions < prompt length are
prefill, the rest decode. A forward id is unknown over HTTP: -1. `ts` is the response's arrival.

    >>> from r3trace.client import capture
    >>> res = capture("http://127.0.0.1:30000", ["Hello", "The capital of"], out="traces/")
    >>> res.tokens, res.run_dir
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import numpy as np
from tqdm import tqdm

from r3trace.capture.wire import decode_routed_experts
from r3trace.trace import Manifest, TraceWriter

Prompt = str | Sequence[int] | Mapping[str, Any]


class CaptureError(RuntimeError):
    """A request failed or its routes do not fit the trace; the message names the prompt index and field."""


class CaptureResult(NamedTuple):
    run_id: str
    run_dir: Path
    requests: int
    tokens: int  # route rows written (token positions)
    skipped: int  # rows left out because a MoE layer held -1 (no route known for that position)


def _body(prompt: Prompt, sampling_params: Mapping[str, Any], start_len: int) -> dict[str, Any]:
    """A prompt (text, token ids, or a /generate body fragment with an optional `tag`) -> /generate body."""
    if isinstance(prompt, str):
        body: dict[str, Any] = {"text": prompt}
    elif isinstance(prompt, Mapping):
        body = {k: v for k, v in prompt.items() if k != "tag"}
    else:
        body = {"input_ids": [int(t) for t in prompt]}
    body.setdefault("sampling_params", dict(sampling_params))
    body.update(return_routed_experts=True, routed_experts_start_len=start_len, stream=False)
    return body


def _manifest_from(
    meta: Mapping[str, Any], info: Mapping[str, Any], num_experts: int | None
) -> dict[str, Any]:
    shape = meta.get("routed_experts_shape")
    layers = meta.get("moe_layer_ids") or info.get("moe_layer_ids")
    e = num_experts or info.get("num_experts")
    if shape is None or layers is None or e is None:
        raise CaptureError(
            "routes: the server gave no routed_experts_shape/moe_layer_ids or num_experts "
            f"(shape={shape}, moe_layer_ids={layers}, num_experts={e}); pass manifest= or num_experts="
        )
    return dict(num_hidden_layers=int(shape[1]), moe_layer_ids=[int(x) for x in layers], num_experts=int(e),
                top_k=int(shape[2]), num_groups=int(info.get("num_groups", 1)))


def _post(client: httpx.Client, index: int, body: dict[str, Any]) -> tuple[int, dict[str, Any], int]:
    r = client.post("/generate", json=body)
    if r.status_code != 200:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:300]
        raise CaptureError(f"prompt {index}: HTTP {r.status_code}: {msg}")
    return index, r.json(), time.time_ns()


def capture(
    url: str,
    prompts: Iterable[Prompt],
    out: str | Path,
    *,
    sampling_params: Mapping[str, Any] | None = None,
    routed_experts_start_len: int = 0,
    manifest: Manifest | None = None,
    num_experts: int | None = None,
    run_id: str | None = None,
    model_name: str | None = None,
    concurrency: int = 8,
    timeout_s: float = 600.0,
    progress: bool = True,
) -> CaptureResult:
    """Send every prompt to `url`/generate with return_routed_experts and write one run under `out`.

    prompts: text, token ids, or dicts holding /generate fields (text/input_ids, sampling_params) and an
    optional `tag` (domain) kept in the requests table. Requests run `concurrency` at a time; rows are
    written in completion order. Returns (run_id, run_dir, requests, tokens, skipped).
    """
    prompt_list = list(prompts)
    if concurrency < 1:
        raise CaptureError(f"concurrency={concurrency} must be >= 1")
    sp = dict(sampling_params or {"max_new_tokens": 32})
    writer: TraceWriter | None = None
    tokens = skipped = 0
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s) as client, \
            ThreadPoolExecutor(max_workers=concurrency) as pool, \
            tqdm(total=len(prompt_list), unit="req", desc="capture", disable=not progress) as bar:
        info: dict[str, Any] = {}
        if manifest is None and num_experts is None:
            r = client.get("/get_model_info")
            info = r.json() if r.status_code == 200 else {}
        futures = [pool.submit(_post, client, i, _body(p, sp, routed_experts_start_len))
                   for i, p in enumerate(prompt_list)]
        try:
            for fut in futures:
                index, result, ts = fut.result()
                meta = result["meta_info"]
                if writer is None:
                    shape = (manifest.__dict__ if manifest is not None else {}) or _manifest_from(
                        meta, info, num_experts)
                    writer = TraceWriter(
                        out, model_name=model_name or str(info.get("model_path", url)), run_id=run_id,
                        num_hidden_layers=shape["num_hidden_layers"], moe_layer_ids=shape["moe_layer_ids"],
                        num_experts=shape["num_experts"], top_k=shape["top_k"],
                        num_groups=shape.get("num_groups", 1), engine={"source": "http", "url": url},
                    )
                written, left_out = _write_one(writer, index, prompt_list[index], result, ts,
                                               routed_experts_start_len)
                tokens, skipped = tokens + written, skipped + left_out
                bar.update(1)
                bar.set_postfix(tokens=tokens, skipped=skipped)
        finally:
            for f in futures:
                f.cancel()
            if writer is not None:
                writer.close()
    if writer is None:
        raise CaptureError("prompts: empty, nothing was captured")
    return CaptureResult(writer.run_id, writer.run_dir, len(prompt_list), tokens, skipped)


def _write_one(
    w: TraceWriter, index: int, prompt: Prompt, result: Mapping[str, Any], ts: int, start: int
) -> tuple[int, int]:
    """One response -> its token rows and its requests-table row; returns (rows written, rows skipped).

    A row with -1 at a MoE layer has no known route (a server that did not capture that position): it is
    left out rather than written as a fake expert id."""
    m = w.manifest
    meta = result["meta_info"]
    if "routed_experts" not in meta:
        raise CaptureError(f"prompt {index}: no routed_experts in meta_info (does the server take the flag?)")
    flat = decode_routed_experts({k: v for k, v in meta.items() if k != "routed_experts_shape"})
    per_row = m.num_hidden_layers * m.top_k
    if flat.size % per_row:
        raise CaptureError(f"prompt {index}: routed_experts holds {flat.size} ids, not a multiple of "
                           f"num_hidden_layers*top_k = {m.num_hidden_layers}*{m.top_k}")
    routes = flat.reshape(-1, m.num_hidden_layers, m.top_k)[:, list(m.moe_layer_ids), :]  # [R, L, K]
    pos = np.arange(start, start + routes.shape[0], dtype=np.int32)
    known = (routes >= 0).all(axis=(1, 2))  # [R]
    routes, pos = routes[known], pos[known]
    rows = routes.shape[0]
    prompt_len = int(meta["prompt_tokens"])
    phase = np.where(pos < prompt_len, "prefill", "decode")
    source = np.where(pos < int(meta.get("cached_tokens", 0)), "prefix_cache", "computed")
    rid = str(meta.get("id", f"req{index}"))
    if rows:
        w.append_tokens(rid, pos, phase, source, -1, ts, 0, routes)
    finish = meta.get("finish_reason") or {}
    tag = prompt.get("tag") if isinstance(prompt, Mapping) else None
    w.add_request(rid, tag=tag, prompt_tokens=prompt_len, completion_tokens=int(meta["completion_tokens"]),
                  finish_reason=finish.get("type"), finish_ts=ts)
    return rows, int((~known).sum())
