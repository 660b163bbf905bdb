"""Grouped top-k (one launch) against its torch reference in the same run (BENCHMARKS.md, "Grouped top-k").

Run (GPU):  python -m bench.topk [--t 1,64,1024,16384] [--out topk.json]
Smoke (CPU): TRITON_INTERPRET=1 python -m bench.topk --smoke

DeepSeek-V3's routing: E = 256 experts in 8 groups, the 4 best groups kept, K = 8, sigmoid scores plus the
correction bias for the choice, weights renormalised and scaled by 2.5. Eager do_bench medians of `grouped_topk`
(fp32 logits [T, E] in, weights and ids out) and of `grouped_topk_ref` (~15 torch ops); ids compared for equality.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.timing import Timer
from r3trace.kernels.topk import grouped_topk, grouped_topk_ref

V3_ROUTING = (8, "sigmoid", "noaux_tc", 8, 4, True, 2.5)  # K, scoring, method, groups, groups kept, renorm, scale


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    timer = Timer(args.device, cpu_reps=1)
    gen = torch.Generator(device=args.device).manual_seed(0)
    bias = torch.randn(256, device=args.device, generator=gen) * 0.1
    rows = []
    for T in args.t:
        logits = torch.randn(T, 256, device=args.device, generator=gen)
        t = timer.eager_ms(partial(grouped_topk, logits, bias, *V3_ROUTING))
        tr = timer.eager_ms(partial(grouped_topk_ref, logits, bias, *V3_ROUTING))
        same = torch.equal(grouped_topk(logits, bias, *V3_ROUTING)[1], grouped_topk_ref(logits, bias, *V3_ROUTING)[1])
        rows.append({"T": T, "ms": t, "torch_ms": tr, "speedup": tr / t, "ids_equal": same})
        print(f"T={T:>6}: triton {t:.4f} ms, torch {tr:.4f} ms ({tr / t:.1f}x), ids equal: {same}", flush=True)
        if not same:
            raise SystemExit(f"grouped_topk's ids differ from grouped_topk_ref's at T = {T}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--t", default="1,64,1024,16384", help="token counts")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, two small T: every code path once (make test)")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    args.t = [1, 7] if args.smoke else [int(t) for t in args.t.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse(argv))


if __name__ == "__main__":
    main()
