"""Where a speculative step's time goes on the sample model: host timers around each phase (a device sync before and
after each, so a phase's row holds its host work plus the GPU work it queued), the GPU time of each graph replayed
alone, and the step time with no sync added.

Run (H200, about 1 minute): python -m bench.spec_step_profile --device cuda --out /tmp/spec_step_profile.json
Run (CPU smoke: fp32 eager engines, batches 1 and 2, 8 new tokens, prompts cut to 32 tokens): --smoke

Phases of one step (engine/event_loop.py, engine/spec/runner.py): schedule (Scheduler.schedule), launch (SpecRunner:
its chain drafts, the target's verify forward, acceptance and the draft extend are timed inside it too; "launch other"
is the rest: the step plan, ForwardBatch, staging copies), collect (the one wait, the results to host lists),
process (Scheduler.process: acceptance on the host, KV trim, hooks). A greedy step on graphs runs _launch_greedy
(greedy_step: the one replay of spec/greedy_step.py, with its load) instead of chain / verify / accept / extend.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.spec_decode import MODEL, engine_options, held_out_prompts
from r3trace.engine import Engine


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(totals: dict[str, float], counts: dict[str, int], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync()
        totals[name] += time.perf_counter() - t0
        counts[name] += 1
        return out

    return wrapper


def _instrument(eng: Engine) -> tuple[dict[str, float], dict[str, int], Callable[[], None]]:
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    targets = [(eng.scheduler, "schedule"), (eng.scheduler, "process"), (eng.runner, "launch"),
               (eng.runner, "collect")]
    runner = eng.runner
    if hasattr(runner, "drafter"):
        targets += [(runner.drafter, "chain"), (runner.drafter, "extend"), (runner, "_accept"),
                    (runner, "_launch_greedy")]
        if runner.spec_graphs is not None:
            targets += [(runner.spec_graphs, "verify_forward"), (runner.spec_graphs, "greedy_step")]
        targets += [(runner.target, "forward_hidden")]
    for obj, name in targets:
        setattr(obj, name, _timed(totals, counts, name, getattr(obj, name)))

    def undo() -> None:
        for obj, name in targets:
            delattr(obj, name)

    return totals, counts, undo


def _graph_us(replay: Callable[[], None], n: int = 200) -> float:
    for _ in range(10):
        replay()
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        replay()
    _sync()
    return (time.perf_counter() - t0) / n * 1e6


def graph_times(eng: Engine) -> dict[str, float]:
    """Each captured graph replayed alone back to back: its GPU time (the host launch is ~10 us and overlaps)."""
    out: dict[str, float] = {}
    runner = eng.runner
    spec = getattr(runner, "spec_graphs", None)
    if spec is not None:
        for kind in ("chain", "verify", "extend", "step"):
            for bs, entry in getattr(spec, f"_{kind}", {}).items():
                out[f"{kind}_bs{bs}"] = _graph_us(entry[0])
    plain = getattr(runner, "graphs", None)
    if plain is not None:
        for bs, (replay, _) in plain.graphs.items():
            out[f"decode_bs{bs}"] = _graph_us(replay)
    return out


def kernel_tables(eng: Engine, batch: int) -> list[str]:
    """torch.profiler over 5 replays of the verify graph (speculative engine) or the decode graph (plain) of one batch
    size: GPU time by kernel (CUPTI sees the kernels inside a graph)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    spec = getattr(eng.runner, "spec_graphs", None)
    replay = spec._verify[batch][0] if spec is not None else eng.runner.graphs.graphs[batch][0]
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            replay()
        _sync()
    return str(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)).splitlines()


def profile(eng: Engine, prompts: list[list[int]], batch: int, max_new: int) -> dict[str, Any]:
    ids = [prompts[i % len(prompts)] for i in range(batch)]
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new}
    eng.generate(input_ids=ids, sampling_params=params)  # warm-up
    eng.flush_cache()
    s0 = int(eng.runner.forward_id)
    t0 = time.perf_counter()
    eng.generate(input_ids=ids, sampling_params=params)
    wall = time.perf_counter() - t0
    steps = int(eng.runner.forward_id) - s0
    eng.flush_cache()
    totals, counts, undo = eng._loop.call(lambda: _instrument(eng))
    eng.generate(input_ids=ids, sampling_params=params)
    eng._loop.call(undo)
    phases = {k: {"ms_per_call": totals[k] / counts[k] * 1e3, "calls": counts[k]} for k in totals}
    return {"batch": batch, "steps": steps, "ms_per_step_unsynced": wall / steps * 1e3,
            "tokens_per_s_incl_prefill": batch * max_new / wall, "phases_synced": phases}


def host_profile(eng: Engine, prompts: list[list[int]], batch: int, max_new: int, top: int = 30) -> str:
    """cProfile of the scheduler thread over one generate: the functions with the most own, then cumulative time."""
    import cProfile
    import io
    import pstats

    ids = [prompts[i % len(prompts)] for i in range(batch)]
    prof = cProfile.Profile()
    eng._loop.call(prof.enable)  # the profiler follows the thread that enabled it: the scheduler's
    eng.generate(input_ids=ids, sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new})
    eng._loop.call(prof.disable)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top + 20)
    return text.getvalue()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="CPU, batches 1 and 2, 8 new tokens, prompts of 32 tokens")
    ap.add_argument("--model", default=str(MODEL), help="a checkpoint with an MTP layer (default: samples/model)")
    ap.add_argument("--kernels", action="store_true", help="CUDA: GPU time by kernel of the verify / decode graphs")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.batches, args.max_new_tokens = "cpu", [1, 2], 8
    prompts = held_out_prompts(40, 32 if args.smoke else 0)
    ns = argparse.Namespace(device=args.device, batches=args.batches)
    result: dict[str, Any] = {}
    for depth in (args.depth, 0):
        name = "spec" if depth else "plain"
        with Engine(args.model, **engine_options(ns, depth, graphs=True)) as eng:
            result[name] = [profile(eng, prompts, b, args.max_new_tokens) for b in args.batches]
            result[name + "_host_profile_b1"] = host_profile(eng, prompts, 1, args.max_new_tokens).splitlines()
            result[name + "_graph_us"] = eng._loop.call(lambda e=eng: graph_times(e))
            if args.kernels and args.device != "cpu":
                for b in args.batches:
                    result[f"{name}_kernels_bs{b}"] = eng._loop.call(lambda e=eng, b=b: kernel_tables(e, b))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
