"""H = 128 MLA decode on Hopper: the Gluon stage 1 at several split policies, graph-timed, against a bf16
GEMM ceiling measured in the same run (issue 6 point 8: >= 50% of it at kv_len >= 8k).

Run (GPU): python bench/mla_decode_h128.py [--old-gluon PATH]   -> table on stdout, JSON in $OUT/mla_decode_h128.json

--old-gluon: a previous kernels/mla_decode_gluon.py (e.g. `git show <rev>:kernels/mla_decode_gluon.py`), timed
at the default's split count in the same run, its stage 1 swapped in for the installed one.

Split policies (decode_tile.py): the launcher default (splits_by_cost), 8 programs per SM rounded up (the
session-3 default) and 4 / 2 / 1 rounded down (whole waves). Run 6 also timed a 32-key x 4-stage schedule
with the next tile's scores under P V (17-22% slower; removed). B = 48 / 8k checks the cost model off the
fitted cells (96 programs a split: one split leaves 36 SMs idle). FLOPs = 2 B H L (576 + 512); the cache
(B L 1152 bytes) is >= 150 MB, 2.5x the 60 MB L2, at kv_len >= 8k, so no rotation (the kv_len 1k cells at
B <= 64, 19-75 MB, partly hit L2: not goal cells).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from sibling import load_path, load_sibling  # bench/sibling.py: python bench/<script>.py puts bench/ on the path
from triton.testing import do_bench

from r3trace.kernels import mla_decode_gluon
from r3trace.kernels.mla_decode import DecodeTile, default_decode_tile, mla_decode

H, KV_LORA, ROPE = 128, 512, 64
CELLS = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)] + [(48, 8192)]
WAVES = [(8, False), (4, True), (2, True), (1, True)]  # (programs per SM, whole waves)


def stage1_ms(sw: ModuleType, stage1: Callable[..., None], fn: partial[torch.Tensor]) -> float:
    """fn timed with `stage1` in place of mla_decode_gluon's stage 1 (mla_decode looks it up per call)."""
    new = mla_decode_gluon.mla_decode_stage1_gluon
    mla_decode_gluon.mla_decode_stage1_gluon = stage1
    try:
        return float(sw.ms(fn))
    finally:
        mla_decode_gluon.mla_decode_stage1_gluon = new


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-gluon", default="", help="a previous mla_decode_gluon.py, timed at the default splits")
    args = ap.parse_args()
    variants: dict[str, Callable[..., None]] = {}  # stage 1s timed at the default's splits beside it
    if args.old_gluon:
        variants["old"] = load_path(args.old_gluon, "old_gluon").mla_decode_stage1_gluon
    sw = load_sibling("mla_decode_sweep.py", "mla_sweep")
    sw.GRAPH = True  # CUDA-graph replays, as the engine decodes
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = 2 * 8192**3 / float(do_bench(partial(torch.matmul, a, b), warmup=25, rep=100, return_mode="median")) / 1e9
    del a, b
    default = default_decode_tile(H, torch.bfloat16, use_gluon=True)
    print(f"bf16 GEMM 8192^3 {gemm:.0f} TFLOP/s; default tile {tuple(default)}", flush=True)
    res: dict[str, object] = {"gemm_TFLOPs": gemm, "default": list(default), "cells": []}
    tiles = {"default": default} | {f"{w}w" + ("" if ww else "-up"): DecodeTile(64, 64, 8, 2, kernel="gluon",
             waves=w, whole_waves=ww) for w, ww in WAVES}  # fmt: skip
    res["rel_err"] = sw.check(default, H)
    print(f"normwise error vs fp32 ref (page 1, mixed lengths, 7 splits): {res['rel_err']:.1e}", flush=True)
    for B, L in CELLS:
        q, kv, r2t, rows, lens = sw.inputs(B, L, H)
        flops = 2 * B * H * L * (KV_LORA + ROPE + KV_LORA)
        timed: dict[int, float] = {}  # splits -> ms (the same kernel: policies of equal splits timed once)
        policies = {name: tile.num_kv_splits(B, H, L, sms) for name, tile in tiles.items()}
        for splits in policies.values():
            if splits not in timed:
                timed[splits] = sw.ms(partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, splits, default))
        rows_out = [{"splits": p, "ms": t, "TFLOPs": flops / t / 1e9, "pct_gemm": 100 * flops / t / 1e9 / gemm}
                    for p, t in timed.items()]  # fmt: skip
        cell: dict[str, object] = {"B": B, "L": L, "policies": policies, "runs": rows_out}
        p = policies["default"]
        call = partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, p, default)
        for name, stage1 in variants.items():
            t_v = stage1_ms(sw, stage1, call)
            cell[name] = {"splits": p, "ms": t_v, "TFLOPs": flops / t_v / 1e9, "default_speedup": t_v / timed[p]}
            print(f"B={B} L={L} {name} at {p} splits: {t_v:.4f} ms ({100 * flops / t_v / 1e9 / gemm:.1f}%), "
                  f"default {timed[p]:.4f}: default {t_v / timed[p]:.2f}x faster", flush=True)  # fmt: skip
        res["cells"].append(cell)  # type: ignore[union-attr]
        best = min(rows_out, key=lambda r: r["ms"])
        print(f"B={B} L={L} splits {policies} | "
              + " ".join(f"{r['splits']}: {r['ms']:.4f} ({r['pct_gemm']:.1f}%)" for r in rows_out)
              + f" | best {best['splits']}", flush=True)  # fmt: skip
        (out_dir / "mla_decode_h128.json").write_text(json.dumps(res, indent=1))
        del q, kv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
