"""What recording a trace costs the engine's decode, and the trace writer's rate on the host CPU.

Run one process per code version (the r3trace on PYTHONPATH is the one measured; its path is in the output):
  PYTHONPATH=SITE python -m bench.trace_cost --ckpt DIR --out trace_cost-LABEL.json
Smoke (CPU): python -m bench.trace_cost --smoke   (the tiny random shape in fp32 with ref backends, a small sink)
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

from bench.decode_rate import bench_checkpoint, bench_prompts, decode_tokens_per_s, open_engine, vocab_size


def engine_cost(ckpt: Path, batch: int, new_tokens: int, reps: int, device: str, backend: str) -> dict[str, Any]:
    """Decode tokens/s with no trace and with a trace recording, alternating in one engine, reps times."""
    import torch

    prompts = bench_prompts(batch, vocab_size(ckpt))
    samples: dict[str, list[float]] = {"off": [], "on": []}
    stalled: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, open_engine(ckpt, backend, batch, new_tokens, device) as eng:
        for _ in range(2):  # warm-up: Triton compiles per shape, the graph is captured
            decode_tokens_per_s(eng, prompts, new_tokens)
        for i in range(reps):
            samples["off"].append(decode_tokens_per_s(eng, prompts, new_tokens))
            eng.start_trace(Path(tmp) / "traces", run_id=f"rep{i}")
            samples["on"].append(decode_tokens_per_s(eng, prompts, new_tokens))
            stalled.append(float(eng.trace_status().get("stalled_s", 0.0)))  # back-pressure on the scheduler
            manifest = eng.stop_trace()
            if manifest is None or manifest["rows"] == 0:
                raise SystemExit(f"the trace of rep {i} recorded no rows: {manifest}")
        rows = manifest["rows"]
    off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": name, "batch": batch, "new_tokens": new_tokens, "runs": samples,
            "off_tokens_per_s": off, "on_tokens_per_s": on, "on_vs_off": on / off, "rows_last_run": rows,
            "stalled_s": stalled}  # fmt: skip


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
            stalled = w.status().stalled_s
        dt = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in Path(tmp).rglob("part-*.parquet"))
    return {"tokens": tokens, "tokens_per_s": tokens / dt, "bytes_per_token": size / tokens, "stalled_s": stalled}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default="", help="checkpoint for the decode part (none: skip it)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sink-tokens", type=int, default=200_000)
    ap.add_argument("--sink-reps", type=int, default=3)
    ap.add_argument("--no-fsync", action="store_true", help="the writer without fsync (a writer that has the option)")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, the tiny random shape, a small sink (make test)")
    args = ap.parse_args(argv)
    device, backend = ("cpu", "ref") if args.smoke else ("cuda", "triton")
    if args.smoke:
        args.batch, args.new_tokens, args.reps, args.sink_tokens, args.sink_reps = 2, 3, 1, 5000, 1
    import r3trace

    report: dict[str, Any] = {"r3trace": str(Path(r3trace.__file__).parent), "argv": sys.argv[1:]}
    opts = {"fsync": False} if args.no_fsync else {}
    report["sink"] = [sink_rate(args.sink_tokens, **opts) for _ in range(args.sink_reps)]
    print("sink:", json.dumps(report["sink"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.ckpt) if args.ckpt else bench_checkpoint(Path(tmp), "tiny", device) if args.smoke else None
        if ckpt is not None:
            report["decode"] = engine_cost(ckpt, args.batch, args.new_tokens, args.reps, device, backend)
            print("decode:", json.dumps(report["decode"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
