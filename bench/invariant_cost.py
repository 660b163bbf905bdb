"""What batch_invariant (--mode all) or row_invariant (--mode row) costs at the 2.5B V3 shape: prefill tokens/s by
prompt length, and decode tokens/s, against the engine with both off.

batch_invariant (EngineConfig) runs every row, prompt rows included, through the fixed-split decode kernel on the
absorbed path and every product through GEMMs that sum K in one order, so prefill, not only decode, can pay for it; this
bench times both against the default engine on the same random checkpoint (bench/random_checkpoint.py), alternating
the two engines rep by rep in one process (both alive), the fastest of `--reps` each.

Prefill: B prompts of N random tokens, generate of 1 new token (prefill plus one sample), chunked_prefill_size 8192,
no prefix cache; tokens/s = B * N / seconds. Decode: bench/decode_rate.py's rate at batch 64 (128-token prompts, one
CUDA graph of the batch).

row_invariant (EngineConfig's default on CUDA) runs batch_invariant's GEMMs, MoE plan and router logits too, but its
prompt rows take the MHA form (the normal MLA path) instead of the absorbed fixed-split attention.

Run (H200, about 3 minutes): python -m bench.invariant_cost --out bench/results/invariant_cost-h200.json
  --mode row: row_invariant against off (bench/results/row_invariant_cost-h200.json)
  --profile FILE: also the torch profiler's kernel table of one prefill of the longest length, each engine
Smoke (make test): --smoke, the tiny random shape on the CPU (fp32, Triton's interpreter, no graphs): one 4-token
prompt, no warm calls, no decode run (the interpreter runs the invariant GEMM's tiles slowly: decode_tokens_per_s is
smoke-run by bench.engine_gpu).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.decode_rate import bench_checkpoint, bench_prompts, decode_tokens_per_s, vocab_size
from r3trace.engine import Engine


def engine(ckpt: Path, mode: str, batch: int, tokens: int, device: str) -> Engine:
    """mode: off (neither invariant mode), row (row_invariant) or all (batch_invariant)."""
    cuda = device == "cuda"
    return Engine(ckpt, dtype="bfloat16" if cuda else "float32", device=device, chunked_prefill_size=8192,
                  max_running_requests=batch, kv_pool_tokens=tokens, enable_prefix_cache=False,
                  cuda_graph_batch_sizes=(batch,) if cuda else (), batch_invariant=mode == "all",
                  row_invariant=mode == "row",
                  **dict.fromkeys(("attention_backend", "moe_backend", "topk_backend", "norm_backend",
                                   "rope_backend"), "triton"))  # fmt: skip


def prefill_seconds(eng: Engine, prompts: list[list[int]]) -> float:
    t0 = time.perf_counter()
    out = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 1, "ignore_eos": True})
    seconds = time.perf_counter() - t0
    refused = [o["error"] for o in out if "error" in o]
    if refused:  # a refused prompt (over the context, say) returns at once: its time would read as a fast prefill
        raise SystemExit(f"prefill of {len(prompts)} x {len(prompts[0])} tokens refused: {refused[0]}")
    return seconds


def profile_prefill(eng: Engine, name: str, prompts: list[list[int]]) -> str:
    """One profiled prefill after a warm one: the kernels by CUDA time, as the torch profiler's table."""
    prefill_seconds(eng, prompts)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        seconds = prefill_seconds(eng, prompts)
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60)
    return f"=== {name}: prefill {len(prompts)} x {len(prompts[0])} tokens, {seconds * 1e3:.1f} ms\n{table}\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v3-2.5b")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 1024, 2048])
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (make test)")
    ap.add_argument("--mode", choices=["all", "row"], default="all",
                    help="all: batch_invariant against off; row: row_invariant against off")
    ap.add_argument("--profile", default="", help="FILE: also profile one prefill of the longest length, CUDA time by "
                    "kernel for each engine (torch profiler), written to FILE")  # fmt: skip
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.shape, args.lengths, args.prefill_batch, args.decode_batch, args.reps = "tiny", [4], 1, 1, 1
    rng = np.random.default_rng(2)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    out: dict[str, Any] = {"device": name, "torch": torch.__version__, "args": vars(args),
                           "prefill": [], "decode": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = bench_checkpoint(Path(tmp), args.shape, device)
        vocab = vocab_size(ckpt)
        pool = max(args.prefill_batch * (max(args.lengths) + 8), args.decode_batch * 200)
        mode = args.mode
        engines = {m: engine(ckpt, m, args.decode_batch, pool, device) for m in ("off", mode)}
        for n in args.lengths:
            prompts = [rng.integers(2, vocab, size=n).tolist() for _ in range(args.prefill_batch)]
            times: dict[str, list[float]] = {m: [] for m in engines}
            for eng in engines.values() if not args.smoke else ():  # warm: kernels compile and tune at this length
                prefill_seconds(eng, prompts)
            for r in range(args.reps):
                for m in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    times[m].append(prefill_seconds(engines[m], prompts))
            rate = {m: args.prefill_batch * n / min(t) for m, t in times.items()}
            out["prefill"].append({"prompt_tokens": n, "batch": args.prefill_batch, "seconds": times,
                                   "tokens_per_s": rate, f"{mode}_vs_off": rate[mode] / rate["off"]})
            print(f"prefill {args.prefill_batch} x {n}: off {rate['off']:,.0f} tok/s, {mode} "
                  f"{rate[mode]:,.0f} ({rate[mode] / rate['off']:.2f}x)", flush=True)
        if not args.smoke:
            prompts = bench_prompts(args.decode_batch, vocab)
            rates: dict[str, list[float]] = {m: [] for m in engines}
            new = 64
            for eng in engines.values():
                decode_tokens_per_s(eng, prompts, new)
            for r in range(args.reps):
                for m in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    rates[m].append(decode_tokens_per_s(engines[m], prompts, new))
            best = {m: max(v) for m, v in rates.items()}
            out["decode"] = {"batch": args.decode_batch, "new_tokens": new, "tokens_per_s_reps": rates,
                             "tokens_per_s": best, f"{mode}_vs_off": best[mode] / best["off"]}
            print(f"decode batch {args.decode_batch}: off {best['off']:,.0f} tok/s, {mode} "
                  f"{best[mode]:,.0f} ({best[mode] / best['off']:.2f}x)", flush=True)
        if args.profile:
            prompts = [rng.integers(2, vocab, size=max(args.lengths)).tolist() for _ in range(args.prefill_batch)]
            Path(args.profile).write_text("\n".join(profile_prefill(e, m, prompts) for m, e in engines.items()))
        for eng in engines.values():
            eng.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
