"""H = 128 MLA decode on Hopper: the two Gluon stage-1 schedules x split counts, graph-timed, against a bf16
GEMM ceiling measured in the same run (issue 6 point 8: >= 50% of it at kv_len >= 8k).

Run (GPU): python bench/mla_decode_h128.py   -> table on stdout, JSON in $OUT/mla_decode_h128.json

Schedules (mla_decode_gluon.GLUON_TILES): 64 keys x 2 stages (S, softmax, P V one after another) and
32 keys x 4 stages (S(t+1) and its softmax under P V(t)). Split counts: each tile's `waves` 8 rounded up
(the session-3 default) and 4 / 2 / 1 programs per SM rounded down (whole waves, longer splits: fewer
prologues, q loads and partial writes per key). FLOPs = 2 B H L (576 + 512); the cache (B L 1152 bytes,
>= 300 MB at kv_len >= 8k) is 5x+ the 60 MB L2, so no rotation.
"""

from __future__ import annotations

import importlib.util
import json
import os
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from triton.testing import do_bench

from r3trace.kernels.mla_decode import DecodeTile, default_decode_tile, mla_decode

H, KV_LORA, ROPE = 128, 512, 64
CELLS = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)]
SCHEDULES = [(64, 2), (32, 4)]  # (block_n, num_stages)
WAVES = [(8, False), (4, True), (2, True), (1, True)]  # (programs per SM, whole waves)


def _sweep() -> ModuleType:
    """bench/mla_decode_sweep.py by path: its graph timer, inputs and reference check."""
    spec = importlib.util.spec_from_file_location("mla_sweep", Path(__file__).with_name("mla_decode_sweep.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    sw = _sweep()
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
    tiles = {
        (n, st, w, ww): DecodeTile(64, n, 8, st, kernel="gluon", waves=w, whole_waves=ww)
        for n, st in SCHEDULES
        for w, ww in WAVES
    }
    errs = {(n, st): sw.check(tiles[(n, st, 8, False)], H) for n, st in SCHEDULES}
    res["rel_err"] = {f"{n}x{st}": e for (n, st), e in errs.items()}
    print("normwise error vs fp32 ref (page 1, mixed lengths, 7 splits):", res["rel_err"], flush=True)
    for B, L in CELLS:
        q, kv, r2t, rows, lens = sw.inputs(B, L, H)
        flops = 2 * B * H * L * (KV_LORA + ROPE + KV_LORA)
        timed: dict[tuple[int, int, int], float] = {}  # (block_n, stages, splits) -> ms
        for tile in tiles.values():
            key = (tile.block_n, tile.num_stages, tile.num_kv_splits(B, H, L, sms))
            if key not in timed:
                timed[key] = sw.ms(partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, key[2], tile))
        rows_out = [{"block_n": n, "stages": st, "splits": p, "ms": t, "TFLOPs": flops / t / 1e9,
                     "pct_gemm": 100 * flops / t / 1e9 / gemm} for (n, st, p), t in timed.items()]  # fmt: skip
        d_splits = default.num_kv_splits(B, H, L, sms)
        res["cells"].append({"B": B, "L": L, "default_splits": d_splits, "runs": rows_out})  # type: ignore[union-attr]
        best = min(rows_out, key=lambda r: r["ms"])
        print(f"B={B} L={L} default {d_splits} splits | "
              + " ".join(f"{r['block_n']}x{r['stages']}/{r['splits']}: {r['ms']:.4f} ({r['pct_gemm']:.1f}%)"
                         for r in rows_out)
              + f" | best {best['block_n']}x{best['stages']}/{best['splits']}", flush=True)  # fmt: skip
        (out_dir / "mla_decode_h128.json").write_text(json.dumps(res, indent=1))
        del q, kv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
