"""SGLang's `sampling_params.stream_interval` on /generate streams: a chunk every `stream_interval` output tokens.

The rule, as SGLang's scheduler applies it (SchedulerOutputProcessorMixin.stream_output_generation,
scheduler_output_processor_mixin.py at sgl-project/sglang 004ec010d0292427acff6a0003fd5fd4c91fb356): an unfinished
request streams when its output count n satisfies n % k == 1 for k > 1 (so after tokens 1, k + 1, 2k + 1, ...),
every token for k = 1 (SGLang's default, the server's --stream-interval 1), and its finishing chunk is always sent.
The engine streams one delta per step; the steps in between are held here and joined into the next chunk sent, so
a client gets the same text, ids, logprobs and route rows in fewer chunks. OpenAI streams send every step (SGLang's
OpenAI bodies carry no stream_interval).
"""

from __future__ import annotations

from typing import Any

from .route_stream import APPENDED, merge_route_deltas


def join_deltas(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive delta chunks of one request as one: text and output_ids concatenated, output logprobs
    appended, route rows joined (the first block's offset kept), any other key the latest (input logprobs and
    prompt_token_ids come in the first chunk only, so they are kept)."""
    meta = merge_route_deltas(a["meta_info"], b["meta_info"])
    for key in APPENDED:
        if key in a["meta_info"] and key in b["meta_info"]:
            meta[key] = a["meta_info"][key] + b["meta_info"][key]
    return {**a, **b, "text": a["text"] + b["text"], "output_ids": a["output_ids"] + b["output_ids"],
            "meta_info": meta}


class IntervalGate:
    """One stream's held deltas: `add` returns the chunk to send now (the held steps joined), or None to hold."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream_interval={interval} must be >= 1")
        self.interval = interval
        self.count = 0  # output tokens so far
        self.held: dict[str, Any] | None = None

    def add(self, delta: dict[str, Any]) -> dict[str, Any] | None:
        self.count += len(delta["output_ids"])
        chunk = delta if self.held is None else join_deltas(self.held, delta)
        finished = delta["meta_info"].get("finish_reason") is not None
        k = self.interval
        if finished or k == 1 or self.count % k == 1:
            self.held = None
            return chunk
        self.held = chunk
        return None


def choice_intervals(sampling_params: Any, n_choices: int, per_prompt: int) -> list[int]:
    """Each choice's stream_interval (1 where unset): one sampling_params for all, or one per prompt, whose n
    choices sit together (prompt-major)."""
    if isinstance(sampling_params, list):
        return [sampling_params[c // per_prompt].stream_interval or 1 for c in range(n_choices)]
    k = sampling_params.stream_interval if sampling_params is not None else None
    return [k or 1] * n_choices
