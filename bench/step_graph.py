"""The decode step's CUDA-graph replay, session 5's path against the fused one, in one process.

Run (GPU): python bench/step_graph.py --out $OUT/step_graph.json [--shape v3-2.5b --batch 64]

Two engines on the same random V3-shaped checkpoint (bench/random_checkpoint.py via engine_gpu.bench_checkpoint),
triton backends and one batch-`batch` decode graph each, differing only in EngineConfig.fuse_step_glue:
  old: kv_a norm, k_pe rope, cat, index store a layer; cast + fp32 cuBLAS GEMM for the router; two cats for the
       shared experts' [T, K + S] routes
  new: the latent_write kernel; the fused router-logits kernel; the top-k kernel storing [T, K + S] itself
A short greedy generate fills the KV (and must give the same tokens in both), then each graph is replayed
`n` times back to back between two CUDA events; the median over `reps` such timings, A and B alternating
(the order flipped every rep, so neither always runs on a warmer GPU). torch.profiler then tables the
kernels of 5 replays of each graph, per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_gpu import backend_options, bench_checkpoint, bench_prompts  # noqa: E402
from step_profile import replay_ms  # noqa: E402

from r3trace.engine import Engine  # noqa: E402

PROFILED_REPLAYS = 5


def open_engine(ckpt: Path, batch: int, new_tokens: int, fuse: bool) -> Engine:
    """engine_gpu.open_engine's engine (bf16, one graph of the full batch, no prefix cache) with the flag."""
    return Engine(ckpt, dtype="bfloat16", device="cuda", chunked_prefill_size=8192, max_running_requests=batch,
                  kv_pool_tokens=batch * (128 + new_tokens + 8), enable_prefix_cache=False,
                  cuda_graph_batch_sizes=(batch,), fuse_step_glue=fuse, **backend_options("triton"))


def kernels_per_step(eng: Engine, batch: int) -> tuple[list[dict[str, Any]], str]:
    """GPU kernels of PROFILED_REPLAYS replays: [{name, calls, us}] per step (sorted by time) and the table."""
    from torch.profiler import ProfilerActivity, profile

    graph, _ = eng.runner.graphs.graphs[batch]  # type: ignore[union-attr]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    rows = [
        {"name": e.key, "calls": e.count / PROFILED_REPLAYS, "us": e.self_device_time_total / PROFILED_REPLAYS}
        for e in prof.key_averages() if e.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r["us"])
    return rows, prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--shape", default="v3-2.5b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", type=int, default=50)
    args = ap.parse_args()
    b = args.batch
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shape": args.shape, "batch": b}
    prompts = bench_prompts(b)
    params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = bench_checkpoint(Path(tmp), args.shape)
        engines = {"old": open_engine(ckpt, b, args.new_tokens, False),
                   "new": open_engine(ckpt, b, args.new_tokens, True)}  # fmt: skip
        outs = {k: eng.generate(input_ids=prompts, sampling_params=params) for k, eng in engines.items()}
        pairs = [(a["output_ids"], c["output_ids"]) for a, c in zip(outs["old"], outs["new"], strict=True)]
        report["requests_with_same_tokens"] = f"{sum(a == c for a, c in pairs)}/{len(pairs)}"
        # where they part: a random bf16 model's near-tied tokens (and routes) flip on last-bit differences
        # (the router's fp32 sums run in another order), after which a request's tokens follow another path
        agree = [next((i for i, (u, v) in enumerate(zip(a, c, strict=False)) if u != v), len(a))
                 for a, c in pairs]
        report["same_tokens_before_first_difference"] = agree
        times: dict[str, list[float]] = {k: [] for k in engines}
        for rep in range(args.reps):
            for k in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                eng = engines[k]
                times[k].append(eng.run_on_scheduler(lambda eng=eng: replay_ms(eng, b, args.n)))
        for k, ts in times.items():
            report[f"replay_ms_{k}"] = ts
            report[f"replay_ms_{k}_median"] = float(np.median(ts))
        report["saved_ms"] = report["replay_ms_old_median"] - report["replay_ms_new_median"]
        for k, eng in engines.items():
            rows, table = eng.run_on_scheduler(lambda eng=eng: kernels_per_step(eng, b))
            report[f"kernels_{k}"] = rows
            report[f"table_{k}"] = table
            report[f"kernel_us_per_step_{k}"] = sum(r["us"] for r in rows)
            eng.shutdown()
    for k, v in report.items():
        if k.startswith("kernels_"):
            continue
        print(f"== {k}\n{v}" if isinstance(v, str) and "\n" in v else f"{k}: {v}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
