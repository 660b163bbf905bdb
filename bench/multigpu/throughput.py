"""Prefill and decode tokens/s of one engine layout on one checkpoint, per GPU, and what capture costs there.

Run by bench/multigpu/__main__.py, one Engine per (shape, layout): one GPU with CUDA-graph decode, one GPU eager,
DP attention over G GPUs (the MoE tensor-parallel over the gathered batch) and DP attention + expert parallelism.
Decode under DP attention or EP runs eager (engine/engine_core.py: their collectives read host counts each forward).

- prefill: `tokens` prompt tokens per DP rank (requests of `prompt` tokens, pinned evenly), one token generated:
  the wall time of the generate call, the fastest of `reps`; tokens/s per GPU = DP ranks x tokens / time / G.
- decode: `batch` requests per DP rank of `decode_prompt` tokens; bench/decode_rate.py's rate (`new_tokens` greedy
  tokens minus one, its prefill), the median of `reps`; per GPU as above.
- capture: the decode again with every request asking for its routes (return_routed_experts) and with a trace
  recording (Engine.start_trace), alternating with capture off in the same engine; overhead = off / on - 1
  (the share of a decode step that capture adds; the goal is < 1%).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.decode_rate import decode_tokens_per_s
from bench.multigpu.cases import Layout
from bench.multigpu.env import multicast_missing
from r3trace.engine import Engine

TRITON = dict.fromkeys(("attention_backend", "moe_backend", "topk_backend", "norm_backend", "rope_backend"), "triton")


@dataclass(frozen=True)
class PerfConfig:
    device: str = "cuda"
    dtype: str = "bfloat16"
    backend: str = "triton"  # triton on a GPU; ref in the CPU smoke
    prefill_tokens: tuple[int, ...] = (4096, 16384)  # per DP rank
    prompt: int = 1024  # tokens of each prefill request
    batches: tuple[int, ...] = (32, 64, 128, 256)  # decode requests per DP rank
    decode_prompt: int = 128
    # 128 new tokens: the rate is (new - 1) tokens over the generate time minus a 1-token call's, and at 32 tokens
    # that difference swung by more than the capture cost it is meant to show (about 1% of a step)
    new_tokens: int = 128
    reps: int = 3
    vocab: int = 32000

    def engine_options(self, graphs: bool) -> dict[str, Any]:
        """One engine holds every measurement: a prefill of max(prefill_tokens) in one forward, max(batches)
        decoding requests, no prefix cache (every prompt is computed); graphs: one CUDA graph per decode batch."""
        kv = max(max(self.prefill_tokens) + self.prompt, max(self.batches) * (self.decode_prompt + self.new_tokens + 8))
        running = max(max(self.batches), max(self.prefill_tokens) // self.prompt)
        opts: dict[str, Any] = dict(dtype=self.dtype, device=self.device, chunked_prefill_size=max(self.prefill_tokens),
                                    max_running_requests=running, kv_pool_tokens=kv, enable_prefix_cache=False)
        if self.backend == "triton":
            opts |= TRITON
        if self.device.startswith("cuda"):
            opts["cuda_graph_batch_sizes"] = tuple(self.batches) if graphs else ()
        return opts


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=length).tolist() for _ in range(n)]


def _pins(n: int, dp: int) -> list[int] | None:
    """Request i on DP rank i % dp: every rank the same count."""
    return None if dp == 1 else [i % dp for i in range(n)]


def _generate(eng: Engine, prompts: list[list[int]], dp: int, new: int) -> float:
    """Seconds of one generate call, requests pinned evenly; any failed request raises."""
    params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    t0 = time.perf_counter()
    out = eng.generate(input_ids=prompts, sampling_params=params, routed_dp_rank=_pins(len(prompts), dp))
    seconds = time.perf_counter() - t0
    errors = [o["error"] for o in out if "error" in o]  # type: ignore[union-attr]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return seconds


def measure(ckpt: Path, layout: Layout, graphs: bool, cfg: PerfConfig, capture: tuple[str, ...], tmp: Path
            ) -> dict[str, Any]:
    """Every prefill and decode figure of one layout (module docstring); capture: the modes timed beside "off"
    ("routes", "trace")."""
    dp, gpus = layout.dp, layout.tp
    out: dict[str, Any] = {"layout": layout.name if gpus > 1 else "1gpu", "gpus": gpus, "graphs": graphs,
                           "prefill": [], "decode": []}  # fmt: skip
    t_start = time.perf_counter()
    with Engine(ckpt, **layout.engine_kwargs(), **cfg.engine_options(graphs)) as eng:
        out["start_s"] = round(time.perf_counter() - t_start, 1)
        out["multicast_env_missing"] = multicast_missing(eng)
        for tokens in cfg.prefill_tokens:
            prompts = _prompts(dp * (tokens // cfg.prompt), cfg.prompt, cfg.vocab, seed=tokens)
            _generate(eng, prompts, dp, 1)  # warm-up: Triton compiles per shape
            best = min(_generate(eng, prompts, dp, 1) for _ in range(cfg.reps))
            out["prefill"].append({"tokens_per_rank": tokens, "seconds": best, "tokens_per_s": dp * tokens / best,
                                   "tokens_per_s_per_gpu": dp * tokens / best / gpus})  # fmt: skip
        for batch in cfg.batches:
            prompts = _prompts(dp * batch, cfg.decode_prompt, cfg.vocab, seed=batch)
            _generate(eng, prompts, dp, min(cfg.new_tokens, 4))  # warm-up
            samples: dict[str, list[float]] = {"off": [], **{mode: [] for mode in capture}}
            modes = list(samples)
            for rep in range(cfg.reps):
                for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:  # each rep starts one mode later
                    if mode == "trace":
                        eng.start_trace(tmp / "traces", run_id=f"{out['layout']}-b{batch}-{rep}")
                    try:  # dp x batch requests a call: round robin gives every DP rank `batch` of them
                        samples[mode].append(decode_tokens_per_s(eng, prompts, cfg.new_tokens, mode == "routes"))
                    finally:
                        if mode == "trace":
                            eng.stop_trace()
            row: dict[str, Any] = {"batch_per_rank": batch, "runs": samples}
            rate = {mode: statistics.median(v) for mode, v in samples.items()}
            row["tokens_per_s"] = rate["off"]
            row["tokens_per_s_per_gpu"] = rate["off"] / gpus
            for mode in capture:
                row[f"{mode}_overhead"] = rate["off"] / rate[mode] - 1  # the share of a step capture adds
            out["decode"].append(row)
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    return out


def ratios(rows: list[dict[str, Any]]) -> None:
    """Adds to each multi-GPU row's figures its per-GPU ratio to the one-GPU rows of the same shape (eager and
    graphs), in place: vs_1gpu_eager, vs_1gpu_graphs."""
    measured = [r for r in rows if "prefill" in r]  # not the rows of a layout that failed or did not run
    base = {r["graphs"]: r for r in measured if r["gpus"] == 1}
    for r in measured:
        if r["gpus"] == 1:
            continue
        for phase, key in (("prefill", "tokens_per_rank"), ("decode", "batch_per_rank")):
            for cell in r[phase]:
                for graphs, name in ((False, "vs_1gpu_eager"), (True, "vs_1gpu_graphs")):
                    cells = base[graphs][phase] if graphs in base else []
                    one = next((c for c in cells if c[key] == cell[key]), None)
                    if one is not None:
                        cell[name] = cell["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
