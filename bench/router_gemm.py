"""The MoE router's fp32 logits: kernels/router_gemm.py's one launch against F.linear(x.float(), w), and a tile sweep.

Run (GPU): python bench/router_gemm.py --out $OUT/router_gemm.json

Timer: one CUDA graph of LAYERS calls, call i on weight set i (as the 11 MoE layers of the end-to-end model
are: each layer's gate weights come from HBM after the layer's experts streamed ~400 MB through the L2),
replayed back to back, events around 20 replays, median of 5, divided by LAYERS. The reference is timed the
same way, in the same process, beside every shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from r3trace.kernels.router_gemm import RouterTile, default_router_tile, router_logits, router_logits_ref

LAYERS = 11
SHAPES = [(64, 2048, 64), (1, 2048, 64), (16, 2048, 64), (256, 2048, 64), (64, 7168, 256)]  # (T, D, E)


def us_per_call(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, ws: list[torch.Tensor]
) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in ws:
            fn(x, w)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            fn(x, w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runs = []
    for _ in range(5):
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / 20 / len(ws))
    return statistics.median(runs)


def _tiled(x: torch.Tensor, w: torch.Tensor, tile: RouterTile) -> torch.Tensor:
    return router_logits(x, w, tile)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--sweep", action="store_true", help="also sweep tiles at every shape")
    args = ap.parse_args()
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "layers": LAYERS, "shapes": {}}
    tiles = [RouterTile(bt, be, bd, wp, st) for bt, be, bd, (wp, st) in itertools.product(
        (16, 32, 64), (16, 32, 64), (64, 128), ((4, 2), (4, 3), (8, 3)))]
    for n, (t, d, e) in enumerate(SHAPES):
        gen = torch.Generator(device="cuda").manual_seed(t + d)
        x = torch.randn(t, d, device="cuda", generator=gen).to(torch.bfloat16)
        ws = [torch.randn(e, d, device="cuda", generator=gen) / d**0.5 for _ in range(LAYERS)]
        row: dict[str, object] = {"ref_us": us_per_call(router_logits_ref, x, ws)}
        row["default_us"] = us_per_call(router_logits, x, ws)
        row["default_tile"] = str(default_router_tile(t, e))
        row["max_abs_diff"] = float((router_logits(x, ws[0]) - router_logits_ref(x, ws[0])).abs().max())
        if args.sweep and n in (0, len(SHAPES) - 1):  # the engine's decode shape and V3's
            sweep = {}
            for tile in tiles:
                if tile.block_t > max(16, t) * 2:
                    continue
                sweep[str(tile)] = us_per_call(partial(_tiled, tile=tile), x, ws)
            best = min(sweep, key=sweep.__getitem__)
            row["best_tile"], row["best_us"] = best, sweep[best]
            row["sweep"] = sweep
        row["ratio_ref_over_default"] = row["ref_us"] / row["default_us"]  # type: ignore[operator]
        res["shapes"][f"T{t}-D{d}-E{e}"] = row  # type: ignore[index]
        print(f"T={t} D={d} E={e}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k != "sweep"), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
