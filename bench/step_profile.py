"""Where a decode step's time goes: GPU time of the graph replay vs the engine's host loop.

Run (GPU):  python -m bench.step_profile --out step_profile.json [--shape v3-2.5b --batch 64] [--ab-overlap]
            [--batch-invariant: the engine with EngineConfig.batch_invariant]
Smoke (CPU): python -m bench.step_profile --smoke   (the tiny shape, ref backends: parts 1, 3 and the overlap A/B;
             the graph replay and the kernel table need CUDA)

1. Decode tokens/s of Engine.generate (triton backends, CUDA-graph decode), capture off and on.
2. The graph replay alone, timed with CUDA events over 50 back-to-back replays: the GPU's share of a step.
3. cProfile of the scheduler thread over one decode run: the host's share, by function.
4. torch.profiler over a few replays: GPU time by kernel (CUPTI traces kernels inside graphs).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.decode_rate import bench_checkpoint, bench_prompts, decode_tokens_per_s, open_engine, vocab_size
from bench.timing import replays_ms
from r3trace.engine import Engine


def replay_ms(eng: Engine, batch: int, n: int = 50) -> float:
    replay, _ = eng.runner.graphs.graphs[batch]  # type: ignore[union-attr]
    for _ in range(5):
        replay()
    return replays_ms(replay, n)


def kernel_table(eng: Engine, batch: int) -> str:
    replay, _ = eng.runner.graphs.graphs[batch]  # type: ignore[union-attr]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            replay()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=45)


def overlap_ab(
    ckpt: Path, prompts: list[list[int]], b: int, n: int, backend: str, device: str, reps: int = 3
) -> dict[str, list[float]]:
    """Decode tokens/s with the overlapped scheduler off and on (capture off and on), alternating engines so
    that drift (power cap, clocks) hits both alike."""
    out: dict[str, list[float]] = {}
    engines = {ov: open_engine(ckpt, backend, b, n, device, overlap_schedule=ov) for ov in (False, True)}
    try:
        for eng in engines.values():
            for capture in (False, True):
                decode_tokens_per_s(eng, prompts, n, capture)  # warm-up
        for _ in range(reps):
            for ov, eng in engines.items():
                for capture in (False, True):
                    key = f"overlap_{'on' if ov else 'off'}_capture_{'on' if capture else 'off'}"
                    out.setdefault(key, []).append(decode_tokens_per_s(eng, prompts, n, capture))
    finally:
        for eng in engines.values():
            eng.shutdown()
    return out


def step_trace(eng: Engine, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """torch.profiler over a whole decode run (capture on): the GPU's busy and idle time between kernels, and the
    kernels of the step outside the graph (copies, scatters, sampling), by name."""
    from torch.profiler import ProfilerActivity, profile

    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.generate(input_ids=prompts, sampling_params=params, return_routed_experts=True)
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in events)
    span = events[-1].time_range.end - events[0].time_range.start if events else 0
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(events, events[1:], strict=False)]
    big = sorted(g for g in gaps if g > 20)
    return {"span_us": span, "busy_us": busy, "kernels": len(events), "gaps_over_20us": len(big),
            "gap_us_total": sum(g for g in gaps if g > 0), "largest_gaps_us": big[-10:],
            "table": prof.key_averages().table(sort_by="count", row_limit=40)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--shape", default="v3-2.5b")
    ap.add_argument("--model", default="", help="a local checkpoint instead (e.g. samples/model)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ab-overlap", action="store_true",
                    help="first time decode with overlap_schedule off then on, alternating, in one process")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, the tiny shape (make test)")
    ap.add_argument("--batch-invariant", action="store_true", help="profile the batch_invariant engine")
    args = ap.parse_args(argv)
    args.device, args.backend, args.reps = ("cpu", "ref", 1) if args.smoke else ("cuda", "triton", 3)
    if args.smoke:
        args.shape, args.batch, args.new_tokens, args.ab_overlap = "tiny", 2, 3, True
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    b, n, dev = args.batch, args.new_tokens, args.device
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                              "shape": args.model or args.shape, "batch": b,
                              "batch_invariant": args.batch_invariant}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.model) if args.model else bench_checkpoint(Path(tmp), args.shape, dev)
        prompts = bench_prompts(b, vocab_size(ckpt))
        if args.ab_overlap:
            report["overlap_ab"] = overlap_ab(ckpt, prompts, b, n, args.backend, dev, args.reps)
        with open_engine(ckpt, args.backend, b, n, dev, batch_invariant=args.batch_invariant) as eng:
            for capture in (False, True):
                decode_tokens_per_s(eng, prompts, n, capture)  # warm-up
            for capture in (False, True):
                tps = [decode_tokens_per_s(eng, prompts, n, capture) for _ in range(2)]
                report[f"decode_tok_s_capture_{'on' if capture else 'off'}"] = tps
                report[f"step_ms_capture_{'on' if capture else 'off'}"] = 1e3 * b / float(np.median(tps))
            if dev == "cuda":  # the graph's replay and its kernels: CUDA only
                report["graph_replay_ms"] = eng.run_on_scheduler(lambda: replay_ms(eng, b))
                report["step_trace"] = step_trace(eng, prompts, n)
            for capture in (True, False):  # the scheduler thread's host time by function, with and without capture
                prof = cProfile.Profile()
                eng.run_on_scheduler(prof.enable)  # profiles the thread that calls it: the scheduler's
                decode_tokens_per_s(eng, prompts, n, capture)
                eng.run_on_scheduler(prof.disable)
                buf = io.StringIO()
                stats = pstats.Stats(prof, stream=buf)
                stats.sort_stats("tottime").print_stats(30)
                stats.sort_stats("cumtime").print_stats(40)
                report["host_profile" if capture else "host_profile_capture_off"] = buf.getvalue()
            if dev == "cuda":
                report["kernels"] = eng.run_on_scheduler(lambda: kernel_table(eng, b))
    for k, v in report.items():
        print(f"== {k}\n{v}" if isinstance(v, str) and "\n" in v else f"{k}: {v}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> None:
    run(parse(argv))


if __name__ == "__main__":
    main()
