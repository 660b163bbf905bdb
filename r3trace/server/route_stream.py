"""Joining a stream's delta chunks, for the streams that send SGLang's shape.

The engine streams deltas: each chunk's text, output_ids, logprobs and route rows are what that step added
(route rows with `routed_experts_offset`). SGLang's default stream (no `--incremental-streaming-output`) sends
the whole output so far in every chunk, and the routes once, at the end; these functions build that from the
deltas.
"""

from __future__ import annotations

from typing import Any

import pybase64

ROW_BLOCKS = ("routed_experts", "routed_experts_physical", "routed_weights")  # base64 blocks of rows, [rows, ...]
BLOCK_KEYS = frozenset(f"{b}{suffix}" for b in ROW_BLOCKS for suffix in ("", "_shape", "_dtype"))
# per output token, in order
APPENDED = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def _join_block(a: str, b: str) -> str:
    # little-endian raw bytes, rows outermost: the bytes of rows i.. then j.. are the bytes of rows i..j..
    return pybase64.b64encode(pybase64.b64decode(a) + pybase64.b64decode(b)).decode("ascii")


def merge_route_deltas(acc: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """meta_info `acc` with the next chunk's `meta` joined on: row blocks appended (shapes summed on rows), the
    offset of the first block kept, every other key the latest value."""
    out = {**acc, **{k: v for k, v in meta.items() if k not in BLOCK_KEYS}}
    for key in ROW_BLOCKS:
        if key not in meta:
            continue
        if key not in acc:
            out[key], out[f"{key}_shape"], out[f"{key}_dtype"] = meta[key], meta[f"{key}_shape"], meta[f"{key}_dtype"]
            continue
        out[key] = _join_block(acc[key], meta[key])
        shape = list(acc[f"{key}_shape"])
        out[f"{key}_shape"] = [shape[0] + meta[f"{key}_shape"][0], *shape[1:]]
        out[f"{key}_dtype"] = meta[f"{key}_dtype"]
    if "routed_experts_offset" in acc:
        out["routed_experts_offset"] = acc["routed_experts_offset"]
    elif "routed_experts_offset" in meta:
        out["routed_experts_offset"] = meta["routed_experts_offset"]
    return out


def is_route_key(key: str) -> bool:
    return key.startswith("routed_") or key == "moe_layer_ids"


class CumulativeStream:
    """/generate's default stream, as SGLang's: each chunk the whole text, output_ids and output logprobs so far;
    the route fields only on the last chunk, whole."""

    def __init__(self) -> None:
        self.text = ""
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {}  # every non-route key seen (input logprobs come in the first chunk only)
        self.routes: dict[str, Any] = {}

    def add(self, chunk: dict[str, Any]) -> dict[str, Any]:
        self.text += chunk["text"]
        self.output_ids += chunk["output_ids"]
        meta = chunk["meta_info"]
        for k, v in meta.items():
            if not is_route_key(k):
                self.meta[k] = self.meta.get(k, []) + v if k in APPENDED else v
        self.routes = merge_route_deltas(self.routes, {k: v for k, v in meta.items() if is_route_key(k)})
        shown = dict(self.meta)
        if meta.get("finish_reason") is not None:
            shown.update((k, v) for k, v in self.routes.items() if k != "routed_experts_offset")
        return {**chunk, "text": self.text, "output_ids": list(self.output_ids), "meta_info": shown}
