"""Fused MoE tiles at speculative-verify sizes on the 2.5B V3 shape (D 2048, I 512, E 64, top-6, bf16): the CUDA-graph
time of one fused_moe call under the default plan (moe_config) and under 11 fixed tile sets, T = 4 .. 256 tokens
(a batch-32 verify of d + 1 = 4 rows is T = 128: 12 rows per expert), with the weight-read floor of the experts the
routes touch (3 x D x I bf16 each, at 4.8 TB/s). Routes: bench/inputs.routes (distinct uniform experts a
token, 15% off-rank ids mapped to expert 0). A tile set whose output leaves the default's by more than 1e-2 (relative
norm) is reported as an error, not timed.

Run (H200, about 30 s): python -m bench.moe_verify_tiles --out bench/results/moe_verify_tiles-h200.json
Smoke (CPU, Triton's interpreter): --smoke runs every tile set once at D 64, I 32, E 8, top-2, T = 5, against the
torch reference (kernels/moe/reference.py), untimed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from bench.inputs import routes
from r3trace.kernels.moe import config as C
from r3trace.kernels.moe.config import GemmTile as G
from r3trace.kernels.moe.config import MoeConfig
from r3trace.kernels.moe.fused_moe import fused_moe
from r3trace.kernels.moe.reference import fused_moe_ref

D, I, E, K = 2048, 512, 64, 6
HBM_BYTES_S = 4.8e12  # the H200's HBM3e bandwidth

TILES = {
    "few16": MoeConfig(16, C.SHORT_D_UP_FEW, C.SHORT_D_DOWN),
    "bm16": MoeConfig(16, C.SHORT_D_UP_BM16, C.SHORT_D_DOWN),
    "bm32": MoeConfig(32, C.SHORT_D_UP_BM32, C.SHORT_D_DOWN_BM32),
    "few16_g2": MoeConfig(16, C.SHORT_D_UP_FEW._replace(group_m=2), C.SHORT_D_DOWN._replace(group_m=2)),
    "few16_g4": MoeConfig(16, C.SHORT_D_UP_FEW._replace(group_m=4), C.SHORT_D_DOWN._replace(group_m=4)),
    "bm32_few": MoeConfig(32, G(32, 256, 1, 4, 2, tma=True), C.SHORT_D_DOWN_BM32),
    "bm32_few3": MoeConfig(32, G(32, 256, 1, 4, 3, tma=True), G(128, 128, 1, 4, 3, tma=True)),
    "bm32_64x256": MoeConfig(32, G(64, 256, 1, 4, 2, tma=True), G(64, 128, 1, 4, 3, tma=True)),
    "bm32_il32": MoeConfig(32, G(32, 256, 1, 4, 2, True, tma=True), G(128, 128, 1, 4, 2, tma=True)),
    "bm32_w8": MoeConfig(32, G(64, 128, 1, 8, 3, True, tma=True), G(128, 128, 1, 8, 2, tma=True)),
    "bm32_dn64": MoeConfig(32, C.SHORT_D_UP_BM32, G(64, 128, 1, 4, 3, tma=True)),
}


def graph_us(fn: Callable[[], object], reps: int = 20) -> float:
    """The fastest of 5 timings of `reps` replays of fn captured as one CUDA graph, in us a call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / reps * 1e3)
    return best


def moe_us(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
           cfg: MoeConfig | None = None) -> float:
    return graph_us(lambda: fused_moe(x, w13, w2, ids, wts, config=cfg))


def smoke() -> None:
    """Every tile set at a tiny shape on the CPU, against the torch reference (fp32: the interpreter's dots)."""
    gen = torch.Generator().manual_seed(0)
    d, i, e, k, t = 64, 32, 8, 2, 5
    w13, w2 = torch.randn(e, 2 * i, d, generator=gen) / d**0.5, torch.randn(e, d, i, generator=gen) / i**0.5
    x = torch.randn(t, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    wts = torch.rand(t, k, generator=gen)
    ref = fused_moe_ref(x, w13, w2, ids, wts)
    for name, tiles in TILES.items():
        cfg = tiles._replace(align=C.align_tile(t * k, e))
        err = ((fused_moe(x, w13, w2, ids, wts, config=cfg) - ref).norm() / ref.norm()).item()
        assert err < 1e-4, f"{name}: relative error {err:.3g} against the reference"
    print(f"{len(TILES)} tile sets match the reference at D {d}, I {i}, E {e}, top-{k}, T {t}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, untimed (make test)")
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    w13, w2 = rnd(E, 2 * I, D) / D**0.5, rnd(E, D, I) / I**0.5
    cpu_gen = torch.Generator().manual_seed(1)
    rows = []
    for t in args.tokens:
        x = rnd(t, D)
        ids = routes(t, E, K, cpu_gen).cuda()
        ids = torch.where(ids < 0, 0, ids)
        wts = torch.rand(t, K, generator=cpu_gen).cuda()
        touched = int(ids.unique().numel())
        row: dict[str, object] = {"T": t, "rows_per_expert": t * K / E, "touched": touched,
                                  "default_us": moe_us(x, w13, w2, ids, wts),
                                  "floor_us": touched * 3 * D * I * 2 / HBM_BYTES_S * 1e6}
        ref = fused_moe(x, w13, w2, ids, wts).float()
        for name, tiles in TILES.items():
            cfg = tiles._replace(align=C.align_tile(t * K, E), pdl=t * K <= C.ALIGN_MAX_PAIRS)
            err = ((fused_moe(x, w13, w2, ids, wts, config=cfg).float() - ref).norm() / ref.norm()).item()
            row[name] = round(moe_us(x, w13, w2, ids, wts, cfg), 1) if err < 1e-2 else f"err {err:.3g}"
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
