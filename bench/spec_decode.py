"""Speculative decoding with the MTP (NextN) layer on the sample model: acceptance per draft depth, decode throughput
with speculation on vs off (CUDA graphs and eager), the cost of route capture with it on, and route mismatches against
plain decoding. One JSON.

Run (H200, about 4-6 minutes): python -m bench.spec_decode --device cuda --out bench/results/spec_decode-h200.json
Run (CPU smoke, fp32 ref backends, 4 prompts of 32 tokens, 8 new, batches 1 and 2, eager; written only with --out):
  python -m bench.spec_decode --smoke

samples/model (bf16 on CUDA with the triton backends; samples/README.md), the 40 held-out prompts of
samples/prompts.jsonl, greedy unless said, ignore_eos so every request generates max_new_tokens. Engines hold at most
max(--batches) requests; their CUDA graphs (on CUDA) are one per timed batch size (--batches), so a timed step never
runs padded. A speculative step replays its graphs when every request verifies d drafts (engine/spec/graphs.py);
each speculative row says how many of its steps did (graph_steps) out of all (steps).
1. acceptance: for d = 1, 2, 3 (with graphs on CUDA) the tokens a verify forward commits (spec_accept_length:
   accepted drafts + 1, summed over requests, divided by verify forwards) and the share of drafts accepted, greedy
   and at temperature 1.
2. decode tokens/s at each batch (prompts cycled): B * (M - 1) generated tokens over the generate time of M tokens
   minus that of 1 token (prefill and first token), each the fastest of --reps; a row also holds every rep's own
   rate, their median and spread. Modes: spec_graphs, spec_eager (d = --depth), plain_graphs, plain_eager (CPU: the
   eager two; speculative engines chain EngineConfig's default of greedy steps a launch on the graphs), and on
   CUDA spec_graphs_s<S> for each S of --launch-steps (spec_graphs with S steps a launch; 1: a launch a step), every
   engine alive at once and their reps interleaved (rep r times each engine once, the order rotated each rep); a
   speculative row's vs_plain is its rate over its plain twin's (spec_graphs_s<S>'s: plain_graphs), vs_plain_reps
   rep by rep.
3. capture cost with speculation on: the speculative rows again with every request asking for routes (capture true),
   beside capture false; plain_graphs too, for reference (plain_eager on CUDA: capture off only).
4. route mismatches against plain decoding, default mode (spec_graphs' engine against plain_graphs'): per request,
   the rows both runs computed for the same tokens (the common prefix of prompt + output; bf16 may end it early),
   (row, layer) pairs whose top-k sets differ, and of those the ones that are not near ties: the K-th minus (K+1)-th
   biased gate score of that row (a direct prefix-free forward of the sequence, engine/replay_check.py's margin) at
   least --near-tie. Counted at several thresholds; the issue asks for 0 past the near ties. The control
   (routes_plain_eager_vs_plain, CUDA): plain decoding's eager engine against its graphs engine, the same count
   between two plain runs whose bf16 kernels differ only in batch shapes and launch (graph vs eager).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import r3trace
from r3trace.capture.recorder import ListRecorder
from r3trace.engine import Engine
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.model import build_model
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.near_tie import gap_hooks
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.weights import load_weights

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "samples" / "model"
THRESHOLDS = (0.0, 1e-3, 1e-2, 3e-2)


def held_out_prompts(n: int, cut: int = 0) -> list[list[int]]:
    """The first n held-out prompts as token ids (the sample model's tokenizer), each cut to `cut` tokens (0: whole,
    75..259 tokens)."""
    from r3trace.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL, ModelConfig.from_hf(MODEL).vocab_size)
    rows = [json.loads(line) for line in (ROOT / "samples" / "prompts.jsonl").read_text().splitlines() if line]
    return [tok.encode(r["text"])[: cut or None] for r in rows[:n]]


def engine_options(args: argparse.Namespace, depth: int, graphs: bool, launch: int | None = None) -> dict[str, Any]:
    """depth 0: plain decoding. graphs: one CUDA graph per timed batch size (CUDA only). launch: greedy speculative
    steps chained per launch (None: EngineConfig's default). --batch-invariant: every engine in batch_invariant mode
    (the triton backends, also on the CPU)."""
    spec: dict[str, Any] = dict(speculative_algorithm="NEXTN", speculative_num_steps=depth) if depth else {}
    if depth and launch is not None:
        spec["speculative_launch_steps"] = launch
    opts: dict[str, Any] = dict(max_running_requests=max(args.batches), **spec)
    triton = dict.fromkeys(("attention_backend", "moe_backend", "topk_backend", "norm_backend", "rope_backend"),
                           "triton")
    if getattr(args, "batch_invariant", False):
        opts.update(batch_invariant=True, **triton)
    if getattr(args, "row_invariant", "auto") == "off":
        opts.update(row_invariant=False)
    if args.device == "cpu":
        return dict(dtype="float32", device="cpu", **opts)
    sizes = tuple(sorted(set(args.batches))) if graphs else ()
    return dict(dtype="bfloat16", device=args.device, page_size=64, cuda_graph_batch_sizes=sizes, **(triton | opts))


def graph_steps(eng: Engine) -> int:
    """Speculative steps that replayed CUDA graphs so far (SpecGraphs.steps: a greedy step's one replay, or a
    sampled step's d - 1 chain, verify and extend replays)."""
    graphs = getattr(eng.runner, "spec_graphs", None)
    return 0 if graphs is None else graphs.graph_steps


def steps_run(eng: Engine) -> int:
    return int(eng.runner.forward_id)


def acceptance_rows(eng: Engine, depth: int, args: argparse.Namespace, prompts: list[list[int]]) -> list[dict]:
    out = []
    for temperature in (0.0, 1.0):
        res = eng.generate(input_ids=prompts, sampling_params={"temperature": temperature, "ignore_eos": True,
                                                               "max_new_tokens": args.max_new_tokens})
        metas = [r["meta_info"] for r in res]
        verifies = sum(m["spec_verify_ct"] for m in metas)
        correct = sum(m["spec_num_correct_drafts"] for m in metas)
        proposed = sum(m["spec_num_proposed_drafts"] for m in metas)
        out.append({"depth": depth, "temperature": temperature, "requests": len(res),
                    "verify_forwards": verifies, "accept_length": (correct + verifies) / max(verifies, 1),
                    "accept_rate": correct / max(proposed, 1)})
        print(f"depth {depth} T={temperature}: accept length {out[-1]['accept_length']:.3f}, "
              f"rate {out[-1]['accept_rate']:.3f}", flush=True)
    return out


def generate_seconds(eng: Engine, ids: list[list[int]], max_new: int, capture: bool) -> float:
    eng.flush_cache()  # every run prefills: the subtraction in rep_rate removes the same prefill
    t0 = time.perf_counter()
    eng.generate(input_ids=ids, sampling_params={"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new},
                 return_routed_experts=capture)
    return time.perf_counter() - t0


def rep_times(eng: Engine, prompts: list[list[int]], batch: int, max_new: int, capture: bool) -> tuple[float, float]:
    """One rep: (time of M tokens, time of 1 token: prefill and first token), each after a cache flush."""
    ids = [prompts[i % len(prompts)] for i in range(batch)]
    return generate_seconds(eng, ids, max_new, capture), generate_seconds(eng, ids, 1, capture)


def decode_rate(batch: int, max_new: int, seconds_m: float, seconds_1: float) -> float:
    """Decode tokens/s: B * (M - 1) tokens over time(M tokens) - time(1 token)."""
    return batch * (max_new - 1) / max(seconds_m - seconds_1, 1e-9)


def captures(mode: str, cuda: bool) -> tuple[bool, ...]:
    """Capture settings timed per mode: plain eager on CUDA is the no-graphs reference only (capture off)."""
    return (False,) if cuda and mode == "plain_eager" else (False, True)


def plain_twin(mode: str) -> str:
    return "plain_graphs" if mode.startswith("spec_graphs_s") else mode.replace("spec_", "plain_")


def throughput_rows(engines: dict[str, Engine], args: argparse.Namespace,
                    prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Decode tokens/s of every mode per batch and capture setting, the modes' reps interleaved: rep r times each
    engine once, in an order rotated every rep, so a drift of clocks or host load over the run reaches every mode
    alike. tokens_per_s is from the fastest time of M tokens and the fastest of 1 token over the reps: stalls only
    add time, and on the H200 host a single generate read up to 5x slow (a rep's own rate then swings 10-90% around
    the median, which the row keeps beside it with the spread (max - min) / median). A speculative row's vs_plain is
    its tokens_per_s over its plain twin's (same graphs setting and capture), vs_plain_reps the same ratio rep by
    rep (both engines timed in the same rep)."""
    cuda = args.device != "cpu"
    m = args.max_new_tokens
    # Warm every engine before any timing: each batch size and capture setting once (kernels compile and tune, the
    # graphs' first replays, allocator pools and clocks settle), so no row is timed on a colder engine than another.
    for batch in args.batches:
        for mode, eng in engines.items():
            for capture in captures(mode, cuda):
                rep_times(eng, prompts, batch, m, capture)
    out = []
    for batch in args.batches:
        for capture in (False, True):
            modes = [x for x in engines if capture in captures(x, cuda)]
            times: dict[str, list[tuple[float, float]]] = {x: [] for x in modes}
            g0 = {x: graph_steps(engines[x]) for x in modes}
            s0 = {x: steps_run(engines[x]) for x in modes}
            for r in range(args.reps):
                for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
                    times[mode].append(rep_times(engines[mode], prompts, batch, m, capture))
            best = {x: decode_rate(batch, m, min(t[0] for t in times[x]), min(t[1] for t in times[x])) for x in modes}
            reps = {x: [decode_rate(batch, m, *t) for t in times[x]] for x in modes}
            for mode in modes:
                med = float(np.median(reps[mode]))
                row: dict[str, Any] = {
                    "mode": mode, "batch": batch, "capture": capture, "tokens_per_s": best[mode],
                    "tokens_per_s_median": med, "tokens_per_s_reps": reps[mode],
                    "spread": (max(reps[mode]) - min(reps[mode])) / med,
                    "seconds_m_reps": [t[0] for t in times[mode]], "seconds_1_reps": [t[1] for t in times[mode]],
                    "graph_steps": graph_steps(engines[mode]) - g0[mode], "steps": steps_run(engines[mode]) - s0[mode]}
                twin = plain_twin(mode)
                if mode != twin and twin in times:
                    ratios = [a / b for a, b in zip(reps[mode], reps[twin], strict=True)]
                    row.update(vs_plain=best[mode] / best[twin], vs_plain_reps=ratios,
                               vs_plain_median=float(np.median(ratios)))
                out.append(row)
                print(f"{mode} batch {batch} capture {capture}: {best[mode]:.1f} tok/s (median {med:.1f}, spread "
                      f"{row['spread']:.0%}" + (f"; {row['vs_plain']:.3f}x {twin}, per rep {min(ratios):.2f}.."
                                                f"{max(ratios):.2f}" if "vs_plain" in row else "")
                      + f"; {row['graph_steps']} of {row['steps']} steps on graphs)", flush=True)
    return out


def greedy_routes(eng: Engine, args: argparse.Namespace, prompts: list[list[int]]) -> list[dict[str, Any]]:
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": args.max_new_tokens}
    return eng.generate(input_ids=prompts, sampling_params=params, return_routed_experts=True)


def measure(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """The acceptance of each depth (an engine each; the throughput depth's is its graphs engine), then every
    throughput engine at once (spec and plain, graphs and eager on CUDA; the eager two on CPU) with interleaved reps,
    then the route runs."""
    cuda = args.device != "cpu"
    result: dict[str, Any] = {"acceptance": [], "throughput": [], "seconds": {}}
    t0 = time.time()
    for depth in () if args.routes_only else args.acceptance_depths:
        if depth != args.depth:
            with Engine(MODEL, **engine_options(args, depth, graphs=cuda)) as eng:
                result["acceptance"] += acceptance_rows(eng, depth, args, prompts)
    with contextlib.ExitStack() as stack:
        modes: dict[str, tuple[int, bool, int | None]] = {
            "spec_graphs": (args.depth, True, None), "spec_eager": (args.depth, False, None),
            "plain_graphs": (0, True, None), "plain_eager": (0, False, None)}
        for launch in args.launch_steps if cuda else ():
            modes[f"spec_graphs_s{launch}"] = (args.depth, True, launch)
        engines = {mode: stack.enter_context(Engine(MODEL, **engine_options(args, depth, graphs, launch)))
                   for mode, (depth, graphs, launch) in modes.items() if cuda or not graphs}
        spec = engines["spec_graphs" if cuda else "spec_eager"]
        if not args.routes_only:
            result["acceptance"] += acceptance_rows(spec, args.depth, args, prompts)
            result["acceptance"].sort(key=lambda row: (row["depth"], row["temperature"]))
            result["seconds"]["acceptance"] = time.time() - t0
            t0 = time.time()
            result["throughput"] = throughput_rows(engines, args, prompts)
            result["seconds"]["throughput"] = time.time() - t0
        runs = {"spec": greedy_routes(spec, args, prompts),
                "plain": greedy_routes(engines["plain_graphs" if cuda else "plain_eager"], args, prompts)}
        if cuda:  # the control: plain decoding against itself, eager kernels vs graphs
            runs["plain_eager"] = greedy_routes(engines["plain_eager"], args, prompts)
        for mode in engines:
            if mode.startswith("spec_graphs_s"):
                runs[mode] = greedy_routes(engines[mode], args, prompts)
    t0 = time.time()
    result["routes"] = route_mismatches(args, prompts, runs["spec"], runs["plain"])
    if "plain_eager" in runs:
        result["routes_plain_eager_vs_plain"] = route_mismatches(args, prompts, runs["plain_eager"], runs["plain"])
    for mode in runs:
        if mode.startswith("spec_graphs_s"):
            result[f"routes_{mode}_vs_plain"] = route_mismatches(args, prompts, runs[mode], runs["plain"])
    result["seconds"]["routes"] = time.time() - t0
    return result


def route_mismatches(args: argparse.Namespace, prompts: list[list[int]], spec: list[dict[str, Any]],
                     plain: list[dict[str, Any]]) -> dict[str, Any]:
    results = {"spec": spec, "plain": plain}
    opts = engine_options(args, 0, graphs=False)
    cfg = ModelConfig.from_hf(MODEL)
    recorder = ListRecorder()
    model = build_model(cfg, EngineConfig(dtype=opts["dtype"], device=args.device), ParallelInfo(), recorder)
    load_weights(model, MODEL)
    margins: dict[int, torch.Tensor] = {}
    hooks = gap_hooks(model.eval(), margins, "set")  # K-th minus (K+1)-th score: set flips
    moe = list(cfg.moe_layer_ids)
    flips: list[float] = []  # the margin of every (row, layer) pair whose top-k sets differ
    in_prompt: list[bool] = []  # whether that pair's row is a prompt row (else a generated token's)
    rows = same_tokens = 0
    for ids, s, p in zip(prompts, results["spec"], results["plain"], strict=True):
        a = r3trace.decode_routed_experts(s["meta_info"])[:, moe]  # [rows, M, K]
        b = r3trace.decode_routed_experts(p["meta_info"])[:, moe]
        n_prompt = len(ids)
        common = 0
        while common < len(s["output_ids"]) and common < len(p["output_ids"]) and \
                s["output_ids"][common] == p["output_ids"][common]:
            common += 1
        same_tokens += int(s["output_ids"] == p["output_ids"])
        n = min(n_prompt + common, len(a), len(b))  # row r reads tokens 0..r: the same in both while r < this
        differ = (np.sort(a[:n], -1) != np.sort(b[:n], -1)).any(-1)  # [n, M]
        rows += n
        if not differ.any():
            continue
        tokens = (ids + p["output_ids"])[:n]
        kv = torch.zeros(cfg.num_hidden_layers, n, cfg.kv_cache_dim, dtype=model.engine_config.torch_dtype,
                         device=args.device)
        r2t = torch.arange(n, dtype=torch.int32, device=args.device).unsqueeze(0)
        fb = ForwardBatch.build(forward_id=0, input_ids=tokens, prefix_lens=[0], extend_lens=[n], req_pool_indices=[0],
                                out_cache_loc=r2t[0], req_to_token=r2t, logits_rows=[n - 1], device=args.device)
        model(fb, kv)
        for j, layer in enumerate(moe):
            flips += margins[layer].numpy()[differ[:, j]].tolist()
            in_prompt += (np.flatnonzero(differ[:, j]) < n_prompt).tolist()
    for h in hooks:
        h.remove()
    margin = np.asarray(flips)
    return {"requests": len(prompts), "same_tokens": same_tokens, "rows_compared": rows,
            "pairs_compared": rows * len(moe), "mismatched_pairs": len(flips),
            "mismatched_pairs_at_or_above_margin": {str(t): int((margin >= t).sum()) for t in THRESHOLDS},
            "near_tie": args.near_tie, "mismatched_past_near_ties": int((margin >= args.near_tie).sum()),
            "prompt_rows_past_near_ties": int(((margin >= args.near_tie) & np.asarray(in_prompt, bool)).sum())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, 4 prompts cut to 32 tokens, 8 new tokens, batches 1 and 2, one rep")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--depth", type=int, default=3, help="speculative_num_steps of the throughput and route runs")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--near-tie", type=float, default=1e-2)
    ap.add_argument("--acceptance-depths", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3],
                    help="draft depths whose acceptance is measured (--depth's always is, on its throughput engine)")
    ap.add_argument("--batch-invariant", action="store_true", help="every engine with batch_invariant=True")
    ap.add_argument("--routes-only", action="store_true", help="only the route runs (no acceptance, no throughput)")
    ap.add_argument("--row-invariant", choices=["auto", "off"], default="auto",
                    help="off: every engine with row_invariant=False (auto: EngineConfig's default, on with the "
                         "triton backends on CUDA)")
    ap.add_argument("--launch-steps", type=lambda s: [int(x) for x in s.split(",") if x], default=[1],
                    help="each S (CUDA): also time spec_graphs_s<S>, spec_graphs with speculative_launch_steps=S")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.prompts, args.max_new_tokens, args.batches, args.reps = "cpu", 4, 8, [1, 2], 1
    prompts = held_out_prompts(args.prompts, 32 if args.smoke else 0)
    t0 = time.time()
    result = {
        "host": platform.node(), "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
        "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "out"},
        **measure(args, prompts),
    }
    result["seconds"]["total"] = time.time() - t0
    if args.smoke and not args.out:  # the smoke run (make test) leaves the tree as it was
        print(f"smoke run done ({result['seconds']['total']:.0f} s)")
        return
    out = Path(args.out or ROOT / "bench" / "results" / f"spec_decode-{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} ({result['seconds']['total']:.0f} s)")


if __name__ == "__main__":
    main()
