"""H = 128 MLA decode on Hopper: the Gluon stage 1 at several split policies, graph-timed, against a bf16
GEMM ceiling measured in the same run (issue 6 point 8: >= 50% of it at kv_len >= 8k).

Run (GPU): python bench/mla_decode_h128.py [--old-gluon PATH]   -> table on stdout, JSON in $OUT/mla_decode_h128.json

--old-gluon: a previous kernels/mla_decode_gluon.py (e.g. `git show <rev>:kernels/mla_decode_gluon.py`), timed
at the default's split count in the same run, its stage 1 swapped in for the installed one.

At the cells where the default takes one split, the same call through the two-stage twin
(DecodeTile.direct=False: fp32 partial, then the merge launch) is timed too.

--parts: where a tile's time goes. The kernel's source with one part cut out (the P V wgmmas, the row max
across the warpgroups, the exponentials, the score wgmmas, the in-loop gathers, the rescale of O), each
timed at B = 16 / 8k and 64 / 8k beside the whole kernel; the results are wrong, only the times count. Also
stage 2 (the merge) alone, graph-timed, at every cell's default split count. --variants NAME=0|1,...: the
stage 1 with those constexpr flags (mla_decode_gluon.FLAGS) too, at the default splits.

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


# (name, source text, replacement): one part of _tile cut out; the replaced text must occur exactly once
SCORES = (
    "    s = warpgroup_mma(qv_s, kv_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)\n"
    "    s = warpgroup_mma(qr_s, kr_t.permute((1, 0)), s, is_async=True)\n"
    "    s = warpgroup_mma_wait(0, deps=(s,))\n"
)
GATHER = "    async_copy.async_copy_global_to_shared(\n        kv_n,"
PARTS = [
    ("no_pv", "    acc = warpgroup_mma(p_s, kv_t, acc, is_async=True)\n", ""),
    ("no_rowmax", "    m_new = gl.maximum(m_i, gl.max(s, axis=1))\n", "    m_new = m_i * 0.0 + 8.0\n"),
    ("no_exp", "    p = gl.exp2(s - m_new[:, None])\n", "    p = s - m_new[:, None]\n"),
    ("no_scores", SCORES, "    s = s_zero + 0.0\n"),
    ("no_gather", GATHER, "    if t < 0:\n      " + GATHER.lstrip()),
    ("no_rescale", "    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]\n", ""),
]


def parts(sw: ModuleType, out_dir: Path, res: dict[str, object]) -> None:
    """Each PARTS cut timed against the whole kernel at two cells, then stage 2 alone at every cell."""
    src = Path(mla_decode_gluon.__file__).read_text()
    out: dict[str, object] = {}
    mods = {"whole": mla_decode_gluon.mla_decode_stage1_gluon}
    for name, old, new in PARTS:
        assert src.count(old) == 1, name
        path = out_dir / f"gluon_{name}.py"
        path.write_text(src.replace(old, new))
        mods[name] = load_path(path, f"gluon_{name}").mla_decode_stage1_gluon
    default = default_decode_tile(H, torch.bfloat16, use_gluon=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, L in [(16, 8192), (64, 8192)]:
        q, kv, r2t, rows, lens = sw.inputs(B, L, H)
        p = default.num_kv_splits(B, H, L, sms)
        call = partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, p, default)
        times = {name: stage1_ms(sw, fn, call) for name, fn in mods.items()}
        out[f"{B}/{L}"] = times
        print(f"parts B={B} L={L} splits {p}: " + " ".join(f"{k} {v:.4f}" for k, v in times.items()), flush=True)
    for B, L in CELLS:
        p = default.num_kv_splits(B, H, L, sms)
        out[f"merge {B}/{L}"] = t = sw.merge_ms(B, H, p, L, sw.ms)  # graph-timed like the whole call
        print(f"stage 2 alone B={B} L={L} splits {p}: {t:.4f} ms", flush=True)
    res["parts"] = out


def gemm_tflops() -> float:
    """The ceiling: bf16 8192^3 torch.matmul, median TFLOP/s. It moved between runs on the same kind of
    machine (795-796 in session 3b, 741-777 in session 4's first runs, the kernel's times within 1%), so
    main() measures it before and after the cells."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / float(do_bench(partial(torch.matmul, a, b), warmup=25, rep=100, return_mode="median")) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-gluon", default="", help="a previous mla_decode_gluon.py, timed at the default splits")
    ap.add_argument("--parts", action="store_true", help="time the kernel with parts cut out; stage 2 alone")
    ap.add_argument("--variants", default="", help="NAME=0|1,...: the stage 1 with these constexpr flags too")
    args = ap.parse_args()
    variants: dict[str, Callable[..., None]] = {}  # stage 1s timed at the default's splits beside it
    if args.old_gluon:
        variants["old"] = load_path(args.old_gluon, "old_gluon").mla_decode_stage1_gluon
    for flag in filter(None, args.variants.split(",")):
        name, value = flag.split("=")
        variants[flag] = partial(mla_decode_gluon.mla_decode_stage1_gluon, flags={name: bool(int(value))})
    sw = load_sibling("mla_decode_sweep.py", "mla_sweep")
    sw.GRAPH = True  # CUDA-graph replays, as the engine decodes
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gemm = gemm_tflops()
    default = default_decode_tile(H, torch.bfloat16, use_gluon=True)
    print(f"bf16 GEMM 8192^3 {gemm:.0f} TFLOP/s; default tile {tuple(default)}", flush=True)
    res: dict[str, object] = {"gemm_TFLOPs": gemm, "default": list(default), "cells": []}
    tiles = {"default": default} | {f"{w}w" + ("" if ww else "-up"): DecodeTile(64, 64, 8, 2, kernel="gluon",
             waves=w, whole_waves=ww) for w, ww in WAVES}  # fmt: skip
    if args.parts:
        parts(sw, out_dir, res)
    res["rel_err"] = sw.check(default, H)
    print(f"normwise error vs fp32 ref (page 1, mixed lengths, 7 splits): {res['rel_err']:.1e}", flush=True)
    for name, stage1 in variants.items():
        new = mla_decode_gluon.mla_decode_stage1_gluon
        mla_decode_gluon.mla_decode_stage1_gluon = stage1
        try:
            res[f"rel_err {name}"] = err = sw.check(default, H)
        finally:
            mla_decode_gluon.mla_decode_stage1_gluon = new
        print(f"  {name}: {err:.1e}", flush=True)
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
        if p == 1:  # the same split count through the two-stage twin (fp32 partial + merge launch)
            two = default._replace(direct=False)
            t_2 = sw.ms(partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, 1, two))
            cell["two_stage"] = {"splits": 1, "ms": t_2, "default_speedup": t_2 / timed[p]}
            print(f"B={B} L={L} two-stage at 1 split: {t_2:.4f} ms; direct {t_2 / timed[p]:.3f}x faster", flush=True)
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
    res["gemm_TFLOPs_after"] = after = gemm_tflops()
    print(f"bf16 GEMM 8192^3 after the cells: {after:.0f} TFLOP/s", flush=True)
    (out_dir / "mla_decode_h128.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
