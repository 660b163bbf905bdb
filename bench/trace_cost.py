"""What recording a trace costs the engine's decode, and the trace writer's rate on the host CPU.

Run one process per code version (the r3trace on PYTHONPATH is the one measured; its path is in the output):
  PYTHONPATH=SITE python bench/trace_cost.py --ckpt DIR --out $OUT/trace_cost-LABEL.json
1. Decode tokens/s of Engine.generate (bf16, triton backends, one CUDA graph of the batch, overlap on) with no
   trace and with a trace recording (Engine.start_trace, default writer settings), alternating in one engine,
   `--reps` times; the median of each. Every request's rows reach the writer while the trace records.
2. The writer alone (--sink-tokens tokens, 58 MoE layers x top-8, Zipf ids, 4,096-token appends, one thread
   appending): tokens/s from the first append to close() returning, and bytes per token on disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def decode_rate(eng: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of new_tokens greedy steps minus a one-token run (the prefill), the faster of two of those."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": n})
        return time.perf_counter() - t0

    before = timed(1)
    total = timed(new_tokens)
    return len(prompts) * (new_tokens - 1) / max(total - min(before, timed(1)), 1e-9)


def engine_cost(ckpt: Path, batch: int, new_tokens: int, reps: int) -> dict[str, Any]:
    import torch

    from r3trace.engine import Engine

    vocab = int(json.loads((ckpt / "config.json").read_text())["vocab_size"])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, vocab, size=128).tolist() for _ in range(batch)]
    backends = dict.fromkeys(("attention_backend", "moe_backend", "topk_backend", "norm_backend", "rope_backend"),
                             "triton")
    samples: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp, Engine(
        ckpt, dtype="bfloat16", device="cuda", chunked_prefill_size=8192, max_running_requests=batch,
        kv_pool_tokens=batch * (128 + new_tokens + 8), enable_prefix_cache=False,
        cuda_graph_batch_sizes=(batch,), **backends,
    ) as eng:
        for _ in range(2):  # warm-up: Triton compiles per shape, the graph is captured
            decode_rate(eng, prompts, new_tokens)
        for i in range(reps):
            samples["off"].append(decode_rate(eng, prompts, new_tokens))
            eng.start_trace(Path(tmp) / "traces", run_id=f"rep{i}")
            samples["on"].append(decode_rate(eng, prompts, new_tokens))
            manifest = eng.stop_trace()
            assert manifest is not None and manifest["rows"] > 0
        rows = manifest["rows"]
    off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
    return {"device": torch.cuda.get_device_name(), "batch": batch, "new_tokens": new_tokens, "runs": samples,
            "off_tokens_per_s": off, "on_tokens_per_s": on, "on_vs_off": on / off, "rows_last_run": rows}


def sink_rate(tokens: int, layers: int = 58, k: int = 8, **writer_options: Any) -> dict[str, float]:
    from r3trace.trace.writer import TraceWriter

    ids = (np.random.default_rng(1).zipf(1.3, size=(tokens, layers, k)) % 256).astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        with TraceWriter(tmp, model_name="bench", num_hidden_layers=layers + 3, moe_layer_ids=range(3, layers + 3),
                         num_experts=256, top_k=k, **writer_options) as w:
            for s in range(0, tokens, 4096):
                n = min(4096, tokens - s)
                w.append_tokens([f"req{(s + i) // 1024}" for i in range(n)], np.arange(s, s + n) % 1024, "decode",
                                "computed", s // 4096, time.time_ns(), 0, ids[s : s + n])
        dt = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in Path(tmp).rglob("part-*.parquet"))
    return {"tokens": tokens, "tokens_per_s": tokens / dt, "bytes_per_token": size / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default="", help="checkpoint for the decode part (none: skip it)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sink-tokens", type=int, default=200_000)
    ap.add_argument("--sink-reps", type=int, default=3)
    ap.add_argument("--no-fsync", action="store_true", help="the writer without fsync (a writer that has the option)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import r3trace

    report: dict[str, Any] = {"r3trace": str(Path(r3trace.__file__).parent), "argv": sys.argv[1:]}
    opts = {"fsync": False} if args.no_fsync else {}
    report["sink"] = [sink_rate(args.sink_tokens, **opts) for _ in range(args.sink_reps)]
    print("sink:", json.dumps(report["sink"]), flush=True)
    if args.ckpt:
        report["decode"] = engine_cost(Path(args.ckpt), args.batch, args.new_tokens, args.reps)
        print("decode:", json.dumps(report["decode"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
