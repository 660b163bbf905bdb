"""MLA decode at the engine's default tile, against the ceilings of the same run (BENCHMARKS.md, "MLA decode").

Run (GPU):  python -m bench.mla_decode [--heads 16,128] [--cells 16x1024,64x8192] [--page-size 64]
                [--tiles NAME=field:value+field:value,...] [--out mla_decode.json]
Smoke (CPU): TRITON_INTERPRET=1 python -m bench.mla_decode --smoke

Per cell (B requests all kv_len long on shuffled pages; bytes = B kv_len (kv_lora + rope) 2, the latent cache read
once; FLOPs = 2 B H kv_len (2 kv_lora + rope)), each call timed as CUDA-graph replays of back-to-back calls with the
cache rotated over copies spanning >= 4x the L2:
  default   the tile the engine takes on this GPU for the heads and page size (default_decode_tile), at its split count
  --tiles   the default with DecodeTile fields replaced, timed beside it (e.g. `wide=kernel:wide`, `plain=pdl:0`;
            digits read as ints), each checked against the fp32 reference first
  read      a Triton kernel streaming the same bytes (grid-stride, the best of 8 and 16 programs an SM): the floor
            a memory-bound decode cannot pass
  GEMM      an 8192^3 bf16 matmul timed before and after each cell (the rate drifts with the power cap); % GEMM is
            against the higher
and once per run the 1 GiB copy (% copy). Normwise error of every tile against mla_decode_ref on 9 requests of
mixed lengths (1-3001 keys) on the same page size.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from bench.inputs import paged_decode_inputs, rotated_decode_cell
from bench.timing import Timer, measure_ceilings
from r3trace.kernels.mla_decode import DecodeTile, default_decode_tile, mla_decode, mla_decode_ref

CELLS = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)]
CHECK_LENS = [1, 700, 3001, 64, 1500, 33, 2049, 5, 999]  # mixed, 1 included, tile and page edges


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Stream x [n] int32 once, grid-stride in BLOCK-element chunks; one sum per program keeps the loads."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    # int64 offsets: the largest cell's cache is 2.4e9 int32 elements
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
        acc += tl.load(x_ptr + start + offs, mask=start + offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def read_floor_ms(timer: Timer, caches: list[torch.Tensor], sms: int) -> float:
    """The streaming read of the caches' bytes, the faster of 8 and 16 programs an SM (4 warps, 16 KB a load)."""
    best = float("inf")
    for per_sm in (8, 16):
        out = torch.empty(sms * per_sm, dtype=torch.int32, device=caches[0].device)
        flat = [c.view(torch.int32).view(-1) for c in caches]
        fns = [partial(_read_kernel[(sms * per_sm,)], x, out, x.numel(), BLOCK=4096, num_warps=4) for x in flat]
        best = min(best, timer.graph_ms(fns))
    return best


def parse_tiles(text: str) -> dict[str, dict[str, Any]]:
    """'wide=kernel:wide,plain=pdl:0+direct:0' -> {"wide": {"kernel": "wide"}, "plain": {"pdl": 0, "direct": 0}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in filter(None, text.split(",")):
        name, _, fields = item.partition("=")
        if not fields:
            raise ValueError(f"--tiles item {item!r} is not NAME=field:value[+field:value]")
        pairs = [f.split(":", 1) for f in fields.split("+")]
        bad = [f for f, *_ in pairs if f not in DecodeTile._fields]
        if bad or any(len(p) != 2 for p in pairs):
            raise ValueError(f"--tiles {name}: fields {bad or fields} not DecodeTile fields {DecodeTile._fields}")
        out[name] = {k: int(v) if v.isdigit() else v for k, v in pairs}
    return out


def parse_cells(text: str) -> list[tuple[int, int]]:
    """--cells "BxL,...": (requests, kv_len) pairs; empty: CELLS."""
    return [(int(b), int(n)) for b, n in (c.split("x") for c in text.split(","))] if text else CELLS


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    """The options of the benches beside a peer's kernel (mla_decode_flashmla.py, mla_decode_sglang.py)."""
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--cells", default="", help="BxL,... (default: B 16, 64, 256 x kv_len 1k, 8k, 32k)")
    ap.add_argument("--rep", type=int, default=20, help="ms of replays a timing (do_bench_cudagraph)")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, r3trace's side only (make test)")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.float() - ref.float()).norm() / ref.float().norm()).item())


def check(tile: DecodeTile, heads: int, kv_lora: int, rope: int, page: int, device: str, lens: list[int]) -> float:
    """Normwise error against the fp32 reference, mixed lengths on `page`-slot shuffled pages, 7 splits."""
    gen = torch.Generator().manual_seed(heads + page)
    inp = paged_decode_inputs(lens, heads, kv_lora, rope, page, torch.bfloat16, device, gen)
    scale = (kv_lora + rope) ** -0.5
    out = mla_decode(*inp, kv_lora, scale, num_kv_splits=7, tile=tile)
    return rel_err(out, mla_decode_ref(inp.q.float(), inp.kv_cache.float(), *inp[2:], kv_lora, scale))


class Gemm:
    """The 8192^3 bf16 GEMM rate (TFLOP/s), timed again at every call (before and after each cell)."""

    def __init__(self, timer: Timer, n: int) -> None:
        self.timer, self.n = timer, n
        dtype = torch.bfloat16 if timer.device == "cuda" else torch.float32
        self.a = torch.randn(n, n, device=timer.device, dtype=dtype)
        self.b = torch.randn(n, n, device=timer.device, dtype=dtype)

    def __call__(self) -> float:
        return 2 * self.n**3 / self.timer.eager_ms(partial(torch.matmul, self.a, self.b)) / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    timer = Timer(args.device, rep_ms=args.rep, cpu_reps=1)
    ceil = measure_ceilings(timer)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if args.device == "cuda" else 4
    hopper = args.device == "cuda" and torch.cuda.get_device_capability()[0] == 9
    gemm = Gemm(timer, 8192 if args.device == "cuda" else 128)
    report: dict[str, Any] = {"ceilings": ceil.as_dict(), "page_size": args.page_size, "cells": [], "errors": {}}
    print(f"ceilings: copy {ceil.copy_gbs:.0f} GB/s, GEMM {ceil.gemm_tflops:.0f} TFLOP/s ({ceil.device})", flush=True)
    scale = (args.kv_lora + args.rope) ** -0.5
    for H in args.heads:
        default = default_decode_tile(H, torch.bfloat16, use_gluon=hopper, kv_lora=args.kv_lora, rope=args.rope,
                                      page_size=args.page_size)  # fmt: skip
        tiles = {"default": default} | {name: default._replace(**f) for name, f in args.tiles.items()}
        report["errors"][f"H{H}"] = errs = {
            name: check(t, H, args.kv_lora, args.rope, args.page_size, args.device, args.check_lens)
            for name, t in tiles.items()
        }
        print(f"H={H} tiles {dict(tiles)}; normwise error vs fp32 ref {errs}", flush=True)
        for B, L in args.cells:
            cell = rotated_decode_cell(B, L, H, args.device, args.kv_lora, args.rope, args.page_size)
            nbytes = cell.nbytes
            row: dict[str, Any] = {"H": H, "B": B, "L": L, "MB": nbytes / 1e6, "gemm_before": gemm(), "tiles": {}}
            for name, tile in tiles.items():
                splits = tile.num_kv_splits(B, H, L, sms)
                t = timer.graph_ms(cell.calls(args.kv_lora, scale, splits, tile))
                pct_copy, tflops = cell.rates(t, ceil.copy_gbs)
                row["tiles"][name] = {"splits": splits, "ms": t, "pct_copy": pct_copy, "TFLOPs": tflops}
            row["read_ms"] = read_floor_ms(timer, cell.caches, sms)
            row["gemm_after"] = gemm()
            g = max(row["gemm_before"], row["gemm_after"])
            for rec in row["tiles"].values():
                rec["pct_gemm"] = 100 * rec["TFLOPs"] / g
                rec["pct_read"] = 100 * row["read_ms"] / rec["ms"]
            report["cells"].append(row)
            print(f"H={H} B={B} L={L} ({nbytes / 1e6:.0f} MB): read floor {row['read_ms']:.4f} ms | "
                  + " | ".join(f"{n} {r['ms']:.4f} ms ({r['splits']} splits) {r['pct_copy']:.0f}% copy "
                               f"{r['TFLOPs']:.0f} TFLOP/s {r['pct_gemm']:.0f}% GEMM" for n, r in row["tiles"].items()),
                  flush=True)  # fmt: skip
            del cell
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--cells", default="", help="BxL,... (default: B 16, 64, 256 x kv_len 1k, 8k, 32k)")
    ap.add_argument("--page-size", type=int, default=64, help="the KV pool's page size (64: Hopper's TMA forms)")
    ap.add_argument("--tiles", default="", help="NAME=field:value+...,...: the default with these fields, beside it")
    ap.add_argument("--kv-lora", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--rep", type=int, default=20, help="ms of graph replays a timing (do_bench_cudagraph)")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: every code path once (make test)")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    args.check_lens = CHECK_LENS
    if args.smoke:  # 16 heads at a 32 + 16 latent: the Triton tile in the interpreter, two splits at most
        args.heads, args.cells, args.kv_lora, args.rope, args.page_size = "16", "2x40", 32, 16, 16
        args.check_lens = [1, 37, 20]
        args.tiles = args.tiles or "pages1=page_size:1"
    args.heads = [int(h) for h in args.heads.split(",")]
    args.cells = parse_cells(args.cells)
    args.tiles = parse_tiles(args.tiles)
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse(argv))


if __name__ == "__main__":
    main()
