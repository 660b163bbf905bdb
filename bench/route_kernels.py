"""The router's two kernels (kernels/router_logits.py, kernels/topk.py) at DeepSeek's routing shapes: us a call
(one CUDA-graph replay a call, fastest of 5 timings) of the launchers as they are against the fixed launch both used
before, launched here directly (logits: [16, 16] tiles x 64-wide steps, 4 warps, 8 parts of D; top-k: 16 tokens a
program, 4 warps), same run; and each row's bits at every T against T = 1024's (row invariance).

Shapes: D = 2048 (the bench models) and 7168 (V3), E = 64 (the 2.5B shape, top-6, 2 shared) and 256 (V3, top-8,
1 shared), noaux_tc, sigmoid, 8 groups.

Run (H200, about a minute): python -m bench.route_kernels --out bench/results/route_kernels-h200.json
Smoke (CPU, Triton's interpreter): --smoke checks the bits across T at a tiny shape, untimed.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton

from bench.moe_verify_tiles import graph_us
from r3trace.kernels.router_logits import _router_logits_kernel, logits_parts, logits_tile, router_logits
from r3trace.kernels.topk import _grouped_topk_kernel, grouped_topk

# D, E, K, shared experts S, groups kept
SHAPES = ((2048, 64, 6, 2, 3), (2048, 256, 8, 1, 4), (7168, 64, 6, 2, 3), (7168, 256, 8, 1, 4))
ROWS = (1, 8, 64, 256, 1024)
GROUPS = 8


def old_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The launch router_logits made before the tile ladder: [16, 16] tiles, 4 warps, 8 parts of 64-wide steps."""
    t, d = x.shape
    e = w.shape[0]
    d_slice = triton.cdiv(triton.cdiv(d, 8), 64) * 64
    n_part = triton.cdiv(d, d_slice)
    parts = torch.empty((n_part, t, e), dtype=torch.float32, device=x.device)
    _router_logits_kernel[(triton.cdiv(t, 16), triton.cdiv(e, 16), n_part)](
        x, w, parts, t, e, d, d_slice, x.stride(0), w.stride(0), parts.stride(0), parts.stride(1),
        BLOCK_T=16, BLOCK_E=16, BLOCK_K=64, UPCAST=not x.is_cuda, num_warps=4)
    return parts


def old_topk(parts: torch.Tensor, bias: torch.Tensor, k: int, s: int, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch grouped_topk made before one token a warp: 16 tokens a program over 4 warps."""
    p, t, e = parts.shape
    weights = torch.empty((t, k + s), dtype=torch.float32, device=parts.device)
    routes = torch.empty((t, k + s), dtype=torch.int32, device=parts.device)
    _grouped_topk_kernel[(triton.cdiv(t, 16),)](
        parts, bias, weights, routes, routes, t, e, 2.5, parts.stride(0), parts.stride(1), weights.stride(0),
        routes.stride(0), routes.stride(0), N_PART=p, TOP_K=k, N_SHARED=s, SPLIT_IDS=False, N_GROUP=GROUPS,
        TOPK_GROUP=kept, GROUP_SIZE=e // GROUPS, SIGMOID=True, HAS_BIAS=True, GROUP_MODE=2, NORMALIZE=True,
        BLOCK_T=16, BLOCK_E=max(16, triton.next_power_of_2(e)), BLOCK_G=GROUPS,
        BLOCK_K=max(2, triton.next_power_of_2(k + s)), num_warps=4)  # fmt: skip
    return weights, routes


def route(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int, s: int, kept: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's row-invariant routing: router_logits at every T, then grouped_topk."""
    parts = router_logits(x, w, torch_above=None)
    return grouped_topk(parts, bias, k, "sigmoid", "noaux_tc", GROUPS, kept, True, 2.5, n_shared=s)


def rows_equal(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, k: int, s: int, kept: int,
               rows: tuple[int, ...]) -> bool:
    """Every T in rows: the first T rows' weights and ids have the bits of those rows routed with all of x."""
    full = route(x, w, bias, k, s, kept)
    cut = (route(x[:t], w, bias, k, s, kept) for t in rows)
    return all(torch.equal(a[:len(b)], b) for got in cut for a, b in zip(full, got, strict=True))


def shape_inputs(d: int, e: int, t: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(d + e)
    x = torch.randn(t, d, generator=gen, device=device).bfloat16()
    w = torch.randn(e, d, generator=gen, device=device) * 0.02
    return x, w, torch.randn(e, generator=gen, device=device) * 0.01


def smoke() -> None:
    x, w, bias = shape_inputs(192, 32, 40, "cpu")
    assert rows_equal(x, w, bias, 4, 1, 2, (1, 3, 17)), "a row's routing moved with T"
    print("route_kernels smoke: rows equal at T = 1, 3, 17 of 40")


def measure() -> list[dict[str, Any]]:
    out = []
    for d, e, k, s, kept in SHAPES:
        x, w, bias = shape_inputs(d, e, max(ROWS), "cuda")
        row: dict[str, Any] = {"D": d, "E": e, "K": k, "shared": s, "bits_equal_across_T": rows_equal(
            x, w, bias, k, s, kept, ROWS)}
        for t in ROWS:
            xt = x[:t]
            parts = router_logits(xt, w, torch_above=None)
            topk = partial(grouped_topk, parts, bias, k, "sigmoid", "noaux_tc", GROUPS, kept, True, 2.5, n_shared=s)
            row[f"T{t}"] = {
                "logits_us": round(graph_us(partial(router_logits, xt, w, torch_above=None)), 2),
                "logits_old_us": round(graph_us(partial(old_logits, xt, w)), 2),
                "tile": list(logits_tile(t, e, logits_parts(d)[1])), "parts": logits_parts(d)[1],
                "topk_us": round(graph_us(topk), 2),
                "topk_old_us": round(graph_us(partial(old_topk, parts, bias, k, s, kept)), 2),
            }  # fmt: skip
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, untimed (make test)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    rows = measure()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
