"""Which op family makes plain bf16 decoding's routes depend on the batch: the route control of bench/spec_decode.py
(plain decoding against itself, only the batching changed) rerun with one family at a time switched to its
reference twin (engine/engine_config.py backends) and once in exact mode. Evidence for making the default kernels
batch-invariant (issue 26 point 5: 0 route mismatches past near ties in default mode).

Run (H200, about 1-2 minutes): python -m bench.spec_route_families --device cuda --out FILE
Run (CPU smoke, fp32 ref backends, 4 prompts of 32 tokens, 8 new): python -m bench.spec_route_families --smoke

Per configuration, one eager engine (no CUDA graphs: the ref backends cannot be captured) generates the held-out
prompts greedily twice: all at once (one batch of --prompts requests) and --group at a time; route_mismatches
(bench/spec_decode.py) counts the (row, layer) pairs whose top-k sets differ between the two, past the near-tie
margin of the default (all triton, bf16) model. A family whose reference twin leaves fewer mismatches than the
all-triton row is one whose triton kernel rounds differently with the batch shape. The batch_invariant row is the
triton backends with EngineConfig.batch_invariant (fixed reduction orders): 0 is its claim.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.spec_decode import MODEL, engine_options, held_out_prompts, route_mismatches
from r3trace.engine import Engine

FAMILIES = ("attention_backend", "moe_backend", "topk_backend", "norm_backend", "rope_backend")


def configurations(device: str) -> dict[str, dict[str, Any]]:
    """name -> backend overrides of engine_options' all-triton default (CPU: everything is ref already)."""
    if device == "cpu":
        return {"ref": {}, "exact": {"deterministic": True}}
    out: dict[str, dict[str, Any]] = {"triton": {}}
    out |= {f"{f.removesuffix('_backend')}=ref": {f: "ref"} for f in FAMILIES}
    out["exact"] = {"deterministic": True, **dict.fromkeys(FAMILIES, "ref")}
    out["batch_invariant"] = {"batch_invariant": True}  # the triton backends with fixed reduction orders
    return out


def runs(eng: Engine, prompts: list[list[int]], group: int, max_new: int) -> tuple[list[dict], list[dict]]:
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new}
    together = eng.generate(input_ids=prompts, sampling_params=params, return_routed_experts=True)
    apart: list[dict] = []
    for i in range(0, len(prompts), group):
        apart += eng.generate(input_ids=prompts[i : i + group], sampling_params=params, return_routed_experts=True)
    return together, apart


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="CPU, 4 prompts cut to 32 tokens, 8 new tokens, groups of 2")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--near-tie", type=float, default=1e-2)
    ap.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.prompts, args.max_new_tokens, args.group = "cpu", 4, 8, 2
    args.batches = [args.prompts]  # engine_options: max_running_requests
    prompts = held_out_prompts(args.prompts, 32 if args.smoke else 0)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
                              "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "out"},
                              "configurations": {}}
    only = set(filter(None, args.only.split(",")))
    for name, overrides in configurations(args.device).items():
        if only and name not in only:
            continue
        t0 = time.time()
        with Engine(MODEL, **(engine_options(args, 0, graphs=False) | overrides)) as eng:
            together, apart = runs(eng, prompts, args.group, args.max_new_tokens)
        row = route_mismatches(args, prompts, together, apart) | {"overrides": overrides, "seconds": time.time() - t0}
        result["configurations"][name] = row
        print(f"{name}: {row['mismatched_past_near_ties']} past near ties of {row['mismatched_pairs']} mismatched "
              f"pairs ({row['pairs_compared']} compared, {row['same_tokens']} of {row['requests']} requests the same "
              f"tokens; {row['seconds']:.0f} s)", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
