"""The fused MoE at small T timed where the engine runs it: after the kernels that precede it in a decode step,
replayed back to back, with no harness flush between replays (issue 6 point 8, small T: within 1.5x of reading
each touched expert's w13 + w2 once at copy bandwidth).

Run (GPU):  python -m bench.moe_in_step [--cells 256x256x1,256x256x2,32x2048x1] [--out moe_in_step.json]
Smoke (CPU): TRITON_INTERPRET=1 python -m bench.moe_in_step --smoke   (tiny shapes, each step timed eagerly)

Why a third timing: the MoE timed alone reads 1.56x (E = 256 / T = 1) under do_bench's flush (256 MB zeroed before
each replay, so the MoE's 88 MB of weights first write back the L2's dirty lines) and 1.43x from a clean L2 (256 MB
read before each), 7.5 us apart (BENCHMARKS.md, "Fused MoE in a decode step"). Neither is the engine's L2. Here each
CUDA graph holds one V3 decode-step tail per rank (TP8 shapes), the MoE's routes coming from the router in the graph:

    o_proj  h [T, 2048] @ W_o^T [2048 -> D]     29 MB of weights (V3: 128 heads x 128 / 8 ranks)
    rmsnorm (residual add fused)                 [T, D]
    router  x @ W_g^T [D -> E], fp32 logits      E = 256: 3.7 MB; grouped top-k (sigmoid, bias, 8 groups, 4 kept)
    MoE     fused_moe on those ids / weights

and the MoE's cost is the difference between the graph with it and the same graph without it, both timed as
back-to-back replays (events around 50 replays, median of 9) rotating over 8 graphs with their own weights and
inputs, so every replay reads its weights from HBM (8 x (29 + 3.7 + touched) MB > the 60 MB L2). What the L2
holds when the MoE starts is what the preceding kernels left: mostly clean weight lines, a few KB of dirty
activations. Touched-read uses the routes the router actually picked in the timed graphs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.timing import Timer, measure_ceilings
from r3trace.kernels.moe import fused_moe, fused_moe_ref
from r3trace.kernels.rmsnorm import rmsnorm
from r3trace.kernels.topk import grouped_topk

V3_DIMS = (7168, 2048, 8)  # (D hidden, o_proj input per rank: V3's 128 heads x 128 v_head / TP8, K top-k)


class Step:
    """One decode-step tail's weights and inputs (one of the rotated sets)."""

    def __init__(self, E: int, I: int, T: int, dims: tuple[int, int, int], dev: str) -> None:
        D, O_IN, K = dims
        bf = torch.bfloat16 if dev == "cuda" else torch.float32
        self.h = torch.randn(T, O_IN, device=dev, dtype=bf)
        self.resid = torch.randn(T, D, device=dev, dtype=bf)
        self.w_o = torch.randn(D, O_IN, device=dev, dtype=bf) / O_IN**0.5
        self.norm_w = 1 + 0.1 * torch.randn(D, device=dev, dtype=bf)
        self.w_g = torch.randn(E, D, device=dev, dtype=bf) / D**0.5
        self.bias = 0.01 * torch.randn(E, device=dev)
        self.w13 = torch.randn(E, 2 * I, D, device=dev, dtype=bf) / D**0.5  # own experts per set: 8 x 2.8 GB
        self.w2 = torch.randn(E, D, I, device=dev, dtype=bf) / I**0.5  # at E = 256 / I = 256 and E = 32 / 2048
        self.E, self.K = E, K
        self.ids = torch.empty(T, K, device=dev, dtype=torch.int32)

    def route(self, ids_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [T, D], topk_weights [T, K], topk_ids [T, K]): o_proj, rmsnorm, router and top-k. V3's routing
        (sigmoid, bias, 8 groups, 4 kept) at E = 256; plain top-k of the sigmoid at E = 32 (EP8: the rank's
        experts only)."""
        a = self.h @ self.w_o.T  # [T, D]
        x, _ = rmsnorm(a, self.norm_w, 1e-6, residual=self.resid)
        logits = (x @ self.w_g.T).float()  # [T, E]
        v3 = self.E == 256
        wts, ids = grouped_topk(logits, self.bias if v3 else None, self.K, "sigmoid", "noaux_tc" if v3 else "greedy",
                                8 if v3 else 1, 4 if v3 else 1, True, 2.5, ids_out=ids_out)  # fmt: skip
        return x, wts, ids

    def run(self, with_moe: bool) -> torch.Tensor:
        x, wts, ids = self.route(self.ids)
        return fused_moe(x, self.w13, self.w2, ids, wts) if with_moe else x


def replay_ms(steps: list[Step], with_moe: bool, n: int = 50, reps: int = 9) -> float:
    """Median over reps of (events around n back-to-back replays rotating over the graphs) / n; on the CPU (the
    smoke run) the wall time of one eager step."""
    if steps[0].h.device.type == "cpu":
        t0 = time.perf_counter()
        steps[0].run(with_moe)
        return (time.perf_counter() - t0) * 1e3
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for s in steps:
            s.run(with_moe)  # compile outside capture
    torch.cuda.synchronize()
    graphs = []
    for s in steps:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            s.run(with_moe)
        graphs.append(g)
    for g in graphs * 3:
        g.replay()  # warm
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            graphs[i % len(graphs)].replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


def cell(E: int, I: int, T: int, copy_gbs: float, dims: tuple[int, int, int], dev: str) -> dict[str, object]:
    D = dims[0]
    steps = [Step(E, I, T, dims, dev) for _ in range(8 if dev == "cuda" else 1)]  # 8 sets: weights from HBM
    s0 = steps[0]
    out = s0.run(True)  # checked against the torch reference on the router's own ids and weights
    x, wts, ids = s0.route()
    ref = fused_moe_ref(x, s0.w13, s0.w2, ids, wts)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    with_moe, without = replay_ms(steps, True), replay_ms(steps, False)
    touched = [torch.unique(s.ids).numel() for s in steps]
    read_ms = statistics.mean(touched) * 3 * I * D * steps[0].w13.element_size() / copy_gbs / 1e6
    moe = with_moe - without
    row = {"E": E, "I": I, "T": T, "step_ms": with_moe, "step_without_moe_ms": without, "moe_ms": moe,
           "touched_experts": touched, "touched_read_ms": read_ms, "x_read": moe / read_ms, "rel_err": err}  # fmt: skip
    print(f"E={E:>3} I={I:>4} T={T}: step {with_moe:.4f} ms, without the MoE {without:.4f} -> MoE {moe:.4f} ms; "
          f"touched-read {read_ms:.4f} ms ({statistics.mean(touched):.1f} experts) -> {moe / read_ms:.2f}x; "
          f"err {err:.1e}")  # fmt: skip
    del steps
    return row


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="256x256x1,256x256x2,256x256x4,32x2048x1", help="ExIxT list")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: every code path once (make test)")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    args.dims = (64, 32, 2) if args.smoke else V3_DIMS
    cells = "16x16x1" if args.smoke else args.cells
    args.cells = [tuple(int(v) for v in c.split("x")) for c in cells.split(",")]
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    ceil = measure_ceilings(Timer(args.device, cpu_reps=1))
    res: dict[str, Any] = {"ceilings": ceil.as_dict(), "cells": []}
    for E, I, T in args.cells:
        res["cells"].append(cell(E, I, T, ceil.copy_gbs, args.dims, args.device))
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> None:
    run(parse(argv))


if __name__ == "__main__":
    main()
