"""The engine's decode tokens/s as every engine bench measures it: the checkpoint, the prompts, the engine's options,
the timing (bench/engine_gpu.py, bench/step_profile.py, bench/trace_cost.py).

A decode rate is a run of new_tokens greedy tokens minus a run of one token (its prefill), for a batch of random
128-token prompts; the one-token run is timed before and after the full one and the faster taken: a single slow
one-token run once took so much off a full run that the rate came out at 70,904 for a ~28,000 engine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.random_checkpoint import write_random_checkpoint
from r3trace.engine import Engine

PROMPT_TOKENS = 128


def backend_options(backend: str) -> dict[str, Any]:
    """ref | triton (CUDA-graph decode, the engine's default on CUDA) | triton-eager (graphs off)."""
    if backend == "ref":
        return dict(attention_backend="ref", moe_backend="ref", topk_backend="ref")
    opts: dict[str, Any] = dict(attention_backend="triton", moe_backend="triton", topk_backend="triton",
                                norm_backend="triton", rope_backend="triton")  # fmt: skip
    if backend == "triton-eager":
        opts["cuda_graph_batch_sizes"] = ()
    return opts


def bench_checkpoint(tmp: Path, shape: str, device: str) -> Path:
    """A random V3-shaped checkpoint (bench/random_checkpoint.py; v3-2.5b is the end-to-end shape) under tmp."""
    ckpt = tmp / shape
    return ckpt if (ckpt / "config.json").exists() else write_random_checkpoint(ckpt, shape, device)


def bench_prompts(batch: int, vocab: int = 32000) -> list[list[int]]:
    """batch random 128-token prompts (seed 1, ids below vocab), the same in every engine bench."""
    rng = np.random.default_rng(1)
    return [rng.integers(2, vocab, size=PROMPT_TOKENS).tolist() for _ in range(batch)]


def vocab_size(ckpt: Path) -> int:
    return int(json.loads((ckpt / "config.json").read_text())["vocab_size"])


def open_engine(ckpt: Path, backend: str, batch: int, new_tokens: int, device: str = "cuda", **extra: Any) -> Engine:
    """The timed engine: bf16 on CUDA (fp32 on the CPU), KV for batch x (128 + new_tokens) tokens, no prefix cache;
    with CUDA graphs, one graph of the full batch (every timed decode step has it). extra: more EngineConfig
    options."""
    opts = {**backend_options(backend), **extra}
    if backend == "triton" and device == "cuda":
        opts["cuda_graph_batch_sizes"] = (batch,)
    return Engine(ckpt, dtype="bfloat16" if device == "cuda" else "float32", device=device, chunked_prefill_size=8192,
                  max_running_requests=batch, kv_pool_tokens=batch * (PROMPT_TOKENS + new_tokens + 8),
                  enable_prefix_cache=False, **opts)  # fmt: skip


def decode_tokens_per_s(eng: Engine, prompts: list[list[int]], new_tokens: int, capture: bool = False) -> float:
    """Decode tokens/s of one batch (the module docstring says how)."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": n}, return_routed_experts=capture)
        return time.perf_counter() - t0

    before = timed(1)
    total = timed(new_tokens)
    prefill_s = min(before, timed(1))
    return len(prompts) * (new_tokens - 1) / max(total - prefill_s, 1e-9)
