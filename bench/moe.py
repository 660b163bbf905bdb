"""The fused MoE at its default tiles, against the dense GEMM and the touched-weight read of the same run
(BENCHMARKS.md, "Fused MoE").

Run (GPU):  python -m bench.moe [--shapes 256x256,32x2048,engine] [--t 1,16,64,256,1024,4096,16384] [--out moe.json]
Smoke (CPU): TRITON_INTERPRET=1 python -m bench.moe --smoke

Shapes: ExI at D = 7168, K = 8 (256x256: DeepSeek-V3 on a TP8 rank, 32x2048: on an EP8 rank); `engine`: the 2.5B
shape's MoE as the engine runs it, D = 2048, 64 routed experts (I = 512, top-6) plus its 2 shared experts fused in
as rows 64 and 65 of every token with weight 1 (66 rows, 8 pairs a token). Routes: K distinct experts a token,
uniform at random, rotated over 8 sets at T <= 64 so the touched weights differ from call to call.

Per (shape, T), bf16, the default `fused_moe` (moe_config's tiles: the gemv path at small T):
  ms        eager do_bench median over the rotated route sets; at T <= 1024 also graph_ms, one CUDA graph of
            back-to-back calls (how the engine decodes)
  dense     one bf16 GEMM [T, D] @ [D, 3 K I] of equal FLOPs (% dense = dense ms / MoE ms)
  read      each touched expert row's w13 + w2 read once at the copy rate of the run (x read = MoE / read, from the
            faster of eager and graph)
  error     normwise against fused_moe_ref, the per-expert torch loop
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from bench.inputs import moe_routes
from bench.timing import Timer, measure_ceilings, rotating
from r3trace.kernels.moe import fused_moe, fused_moe_ref


class MoeShape(NamedTuple):
    D: int  # hidden
    E: int  # routed experts
    I: int  # moe_intermediate_size
    K: int  # routed top-k
    S: int = 0  # shared experts fused in as rows E .. E + S - 1 (weight 1 on every token)


SHAPES = {"256x256": MoeShape(7168, 256, 256, 8), "32x2048": MoeShape(7168, 32, 2048, 8),
          "engine": MoeShape(2048, 64, 512, 6, 2)}  # fmt: skip
SMOKE_SHAPES = {"8x32": MoeShape(64, 8, 32, 2), "engine": MoeShape(64, 6, 32, 2, 1)}


def routes(shape: MoeShape, T: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, K + S] int32, topk_weights [T, K + S] fp32): routed pairs, then the shared rows at weight 1."""
    ids = moe_routes(T, shape.E, shape.K, device, gen)
    wts = torch.rand(T, shape.K, generator=gen, device=gen.device).to(device)
    if shape.S:
        shared = torch.arange(shape.E, shape.E + shape.S, device=device, dtype=torch.int32).expand(T, shape.S)
        ids = torch.cat([ids, shared], dim=1)
        wts = torch.cat([wts, torch.ones(T, shape.S, device=device)], dim=1)
    return ids, wts


def cell(shape: MoeShape, T: int, timer: Timer, copy_gbs: float, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, Any]:
    dev = timer.device
    D, I, pairs = shape.D, shape.I, shape.K + shape.S
    gen = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, D, device=dev, generator=gen).to(w13.dtype)
    sets = [routes(shape, T, dev, gen) for _ in range(8 if T <= 64 and dev == "cuda" else 1)]
    fns = [partial(fused_moe, x, w13, w2, ids, wts) for ids, wts in sets]
    ref = fused_moe_ref(x, w13, w2, *sets[0]).float()
    err = float(((fns[0]().float() - ref).norm() / ref.norm()).item())
    t = timer.eager_ms(rotating(fns))
    tg = timer.graph_ms(fns) if T <= 1024 and dev == "cuda" else None
    dense_w = torch.randn(D, 3 * pairs * I, device=dev, dtype=w13.dtype)
    td = timer.eager_ms(partial(torch.matmul, x, dense_w))  # [T, D] @ [D, 3 K I]: the MoE's FLOPs
    touched = sum(torch.unique(ids).numel() for ids, _ in sets) / len(sets)
    read_ms = touched * 3 * I * D * w13.element_size() / copy_gbs / 1e6
    best = min(t, tg) if tg is not None else t
    row = {"D": D, "E": shape.E + shape.S, "I": I, "pairs": pairs, "T": T, "ms": t, "graph_ms": tg,
           "TFLOPs": 2 * T * pairs * 3 * I * D / t / 1e9, "dense_ms": td, "pct_dense": 100 * td / t,
           "touched_rows": touched, "touched_read_ms": read_ms, "x_read": best / read_ms, "rel_err": err}  # fmt: skip
    graph = f"graph {tg:.4f} " if tg is not None else ""
    print(f"D={D} E={shape.E}+{shape.S} I={I} T={T}: {t:.4f} ms {graph}| dense {td:.4f} ({row['pct_dense']:.0f}%) | "
          f"read {read_ms:.4f} ({row['x_read']:.2f}x) | err {err:.1e}", flush=True)  # fmt: skip
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    timer = Timer(args.device, rep_ms=args.rep, cpu_reps=1)
    ceil = measure_ceilings(timer)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    report: dict[str, Any] = {"ceilings": ceil.as_dict(), "rows": []}
    for name in args.shapes:
        shape = args.table[name]
        rows_e = shape.E + shape.S
        gen = torch.Generator(device=args.device).manual_seed(0)
        w13 = (torch.randn(rows_e, 2 * shape.I, shape.D, device=args.device, generator=gen) / shape.D**0.5).to(dtype)
        w2 = (torch.randn(rows_e, shape.D, shape.I, device=args.device, generator=gen) / shape.I**0.5).to(dtype)
        for T in args.t[name]:
            report["rows"].append({"shape": name, **cell(shape, T, timer, ceil.copy_gbs, w13, w2)})
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
        del w13, w2
    return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="256x256,32x2048,engine", help=f"of {list(SHAPES)}")
    ap.add_argument("--t", default="1,16,64,256,1024,4096,16384", help="token counts")
    ap.add_argument("--rep", type=int, default=100, help="ms of timed calls a timing (do_bench)")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: every code path once (make test)")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    args.table = SMOKE_SHAPES if args.smoke else SHAPES
    args.shapes = list(SMOKE_SHAPES) if args.smoke else args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in args.table]
    if unknown:
        ap.error(f"--shapes {unknown} not in {list(args.table)}")
    ts = [int(t) for t in args.t.split(",")]
    args.t = {name: ts for name in args.shapes}
    if args.smoke:  # T = 1: the gemv path; T = 5 with a shared row: the grouped path (align, two GEMMs, sum)
        args.t = {"8x32": [1], "engine": [5]}
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse(argv))


if __name__ == "__main__":
    main()
