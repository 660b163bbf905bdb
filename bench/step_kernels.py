"""GPU time by kernel of one CUDA-graph decode replay of bench/capture.py's model (DeepSeek-V3's routing and MLA
dims, hidden 2048), row_invariant on and off, each batch at a fixed context: where the row-invariant step's time goes.

Run (H200, about a minute): python -m bench.step_kernels --layers 12 --context 1024 --batches 1,256 \
    --out bench/results/step_kernels-v3routing-12l-h200.json
Per mode and batch: the replay's time (CUDA events over 20 replays), the summed kernel time and launches of one replay
(torch.profiler over 5), and each kernel's time and launches a replay.
Smoke (CPU, make test): --smoke, 2 layers at hidden 64 and 16 experts, eager forwards (no graphs) with ref backends,
the CPU profiler's ops in place of kernels.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.capture import random_model, v3_routing_config
from bench.timing import replays_ms
from r3trace.capture.recorder import NullRecorder
from r3trace.engine.cuda_graph import DecodeGraphs
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.forward_batch import ForwardBatch

TRITON = dict(attention_backend="triton", moe_backend="triton", topk_backend="triton", norm_backend="triton",
              rope_backend="triton")  # fmt: skip
REPLAYS = 5


def decode_batch(b: int, context: int, device: str = "cuda") -> ForwardBatch:
    r2t = torch.arange(b * context, dtype=torch.int32, device=device).view(b, context)
    return ForwardBatch.build(
        forward_id=0, input_ids=list(range(7, 7 + b)), prefix_lens=[context - 1] * b, extend_lens=[1] * b,
        req_pool_indices=list(range(b)), out_cache_loc=r2t[:, -1].long(), req_to_token=r2t,
        logits_rows=list(range(b)), device=device, request_ids=[f"r{i}" for i in range(b)], phases=["decode"] * b,
    )


def replay_kernels(replay: Any, device: str = "cuda") -> dict[str, Any]:
    """replay() runs one decode step (a graph replay on CUDA, an eager forward on the CPU) -> its time and the
    profiler's table of one step (CUDA kernels, or the CPU's ops)."""
    cuda = device == "cuda"
    for _ in range(5 if cuda else 1):
        replay()
    if cuda:
        torch.cuda.synchronize()
        replay_ms = replays_ms(replay)
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(REPLAYS):
            replay()
        if cuda:
            torch.cuda.synchronize()
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    for ev in prof.events():
        if ev.device_type == kind:
            agg[ev.name[:60]][0] += (ev.device_time if cuda else ev.self_cpu_time_total) / REPLAYS
            agg[ev.name[:60]][1] += 1
    return {"replay_ms": replay_ms if cuda else float("nan"),
            "kernel_us": sum(v[0] for v in agg.values()), "launches": sum(v[1] for v in agg.values()) // REPLAYS,
            "kernels": {k: (round(v[0], 1), int(v[1]) // REPLAYS) for k, v in agg.items()}}  # fmt: skip


def smoke() -> None:
    cfg = v3_routing_config(2, hidden=64, experts=16)
    ecfg = EngineConfig(dtype="float32", device="cpu", kv_pool_tokens=16, chunked_prefill_size=16,
                        max_running_requests=2, row_invariant=False)
    model = random_model(cfg, ecfg, NullRecorder())
    kv = torch.randn(cfg.num_hidden_layers, 17, cfg.kv_cache_dim) * 0.1
    fb = decode_batch(2, 8, "cpu")
    got = replay_kernels(lambda: model(fb, kv), "cpu")
    assert got["launches"] > 0 and got["kernel_us"] > 0, got
    print(f"step_kernels smoke: {got['launches']} ops a step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, 2 tiny layers, eager (make test)")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    batches = [int(b) for b in args.batches.split(",")]
    out = {}
    for row_invariant in (True, False):
        cfg = v3_routing_config(args.layers)
        ecfg = EngineConfig(dtype="bfloat16", device="cuda", kv_pool_tokens=max(batches) * args.context,
                            chunked_prefill_size=512, max_running_requests=max(batches), row_invariant=row_invariant,
                            **TRITON)  # fmt: skip
        model = random_model(cfg, ecfg, NullRecorder())
        kv = torch.randn(cfg.num_hidden_layers, ecfg.kv_pool_tokens + 1, cfg.kv_cache_dim, dtype=torch.bfloat16,
                         device="cuda") * 0.1  # fmt: skip
        for b in batches:
            fb = decode_batch(b, args.context)
            graphs = DecodeGraphs(model, kv, fb.req_to_token, (b,), args.context, kv.shape[1] - 1)
            key = f"ri={row_invariant} b={b}"
            out[key] = replay_kernels(graphs.graphs[b][0])
            print(f"{key}: replay {out[key]['replay_ms']:.3f} ms, kernels {out[key]['kernel_us'] / 1e3:.3f} ms, "
                  f"launches {out[key]['launches']}", flush=True)
            del graphs
        del model, kv
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
