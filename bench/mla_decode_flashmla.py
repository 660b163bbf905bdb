"""r3trace's MLA decode beside FlashMLA's dense decode, the kernel issue 6's anchor names ("about 3000 GB/s
memory-bound on an H800"): the same cells, the same inputs, the same run (H200).

Run (GPU): python bench/mla_decode_flashmla.py --flashmla DIR [--heads 16,128] [--cells BxL,...]
    -> table on stdout, JSON in $OUT/mla_decode_flashmla.json

DIR: a checkout of deepseek-ai/FlashMLA with its csrc/cutlass submodule's include/ and tools/util/include/ present,
fetched beside the project and never committed (bench/NOTES.md names both commits). Only its sm90 dense decode is
built (build_flashmla: the scheduling-metadata kernel, the split-KV kernel, the combine kernel, bf16 only), through
torch's cpp_extension with FlashMLA's own nvcc flags for sm_90a; a three-line binding written here exposes its
dense_attn_decode_interface, the function its Python flash_mla_with_kvcache calls. The build needs the CUDA
toolkit's nvcc (the device image has 13.0) and takes minutes.

FlashMLA's call as SGLang's and vLLM's FlashMLA backends make it: q [B, 1, H, 576], the cache viewed as [pages, 64,
1, 576], the block table = each request's page ids (r3trace's shuffled 64-slot pages, so slots // 64), int32 lengths;
the scheduling metadata computed once per batch, outside the timed call (the backends compute it once per forward,
for every layer; r3trace's split count likewise comes from host lengths). Its call allocates its outputs and
partials each time (torch.empty, from the graph's pool when captured). r3trace: mla_decode with the engine's Hopper
tile on 64-slot pages at its own split count. Both timed by mla_decode_floor.graph_ms (one CUDA graph of
back-to-back calls, median; caches rotated over copies spanning >= 4x the L2 at small cells), after both are
checked against mla_decode_ref. The bf16 GEMM ceiling (8192^3 torch.matmul) is taken before and after each head
count's cells, the % GEMM columns against the higher.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from sibling import load_sibling  # bench/sibling.py: python bench/<script>.py puts bench/ on the path

from r3trace.kernels.mla_decode import default_decode_tile, mla_decode, mla_decode_ref

KV_LORA, ROPE, PAGE = 512, 64, 64
CELLS = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)]
SCALE = (KV_LORA + ROPE) ** -0.5
BINDING = """#include <pybind11/pybind11.h>
#include "api/dense_decode.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("dense_decode_fwd", &dense_attn_decode_interface); }
"""
SOURCES = (
    "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "smxx/decode/combine/combine.cu",
    "sm90/decode/dense/instantiations/bf16.cu",
)
# FlashMLA's setup.py nvcc flags, less its ptxas verbosity and source-in-PTX (build logs only)
NVCC_FLAGS = [
    "-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
    "-DFLASH_MLA_DISABLE_FP16", "-gencode", "arch=compute_90a,code=sm_90a",
]  # fmt: skip


def build_flashmla(src: Path, build: Path) -> ModuleType:
    """FlashMLA's sm90 dense decode as a torch extension (see the module doc)."""
    from torch.utils.cpp_extension import CUDA_HOME, load

    csrc = src / "csrc"
    for need in (csrc / "api" / "dense_decode.h", csrc / "cutlass" / "include" / "cute"):
        if not need.exists():
            raise SystemExit(f"--flashmla {src}: {need} missing (FlashMLA checkout with csrc/cutlass populated?)")
    build.mkdir(parents=True, exist_ok=True)
    binding = build / "flashmla_dense_binding.cpp"
    binding.write_text(BINDING)
    includes = [csrc, csrc / "kerutils" / "include", csrc / "sm90", csrc / "cutlass" / "include",
                csrc / "cutlass" / "tools" / "util" / "include"]  # fmt: skip
    # CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl: nvcc looks there by itself, the host compiler
    # building the binding does not
    cccl = Path(CUDA_HOME or "/usr/local/cuda") / "include" / "cccl"
    cflags = ["-O3", "-std=c++20", "-DNDEBUG", "-DFLASH_MLA_DISABLE_FP16"] + ([f"-I{cccl}"] if cccl.is_dir() else [])
    return load(
        name="flashmla_dense", sources=[str(binding)] + [str(csrc / s) for s in SOURCES],
        extra_cflags=cflags, extra_cuda_cflags=NVCC_FLAGS,
        extra_include_paths=[str(p) for p in includes], build_directory=str(build), verbose=False,
    )  # fmt: skip


class FlashMlaCall:
    """dense_decode_fwd on r3trace's inputs (q [B, H, 576], the cache [S, 576] of 64-slot pages, req_to_token
    [B, L]); the scheduling metadata from one untimed call."""

    def __init__(self, fm: ModuleType, q: torch.Tensor, kv: torch.Tensor, r2t: torch.Tensor, lens: torch.Tensor):
        B, H, C = q.shape
        self.fm = fm
        self.q = q.view(B, 1, H, C)
        self.k = kv.view(-1, PAGE, 1, C)
        # r3trace's pages hold 64 consecutive slots from a multiple of 64: a request's page ids are its slots // 64
        self.table = (r2t[:, ::PAGE] // PAGE).to(torch.int32).contiguous()
        self.lens = lens.to(torch.int32)
        _, _, self.meta, self.splits = fm.dense_decode_fwd(self.q, self.k, KV_LORA, self.lens, self.table, SCALE,
                                                           False, None, None)  # fmt: skip

    def __call__(self) -> torch.Tensor:
        out = self.fm.dense_decode_fwd(self.q, self.k, KV_LORA, self.lens, self.table, SCALE, False, self.meta,
                                       self.splits)[0]  # fmt: skip
        return out.view(out.shape[0], out.shape[2], KV_LORA)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.float() - ref.float()).norm() / ref.float().norm()).item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flashmla", required=True, help="FlashMLA checkout (csrc/ with cutlass headers)")
    ap.add_argument("--build", default="/tmp/flashmla_build")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--cells", default="", help="BxL,... (default: the nine issue-6 cells)")
    ap.add_argument("--rep", type=int, default=20, help="ms of replays per retry (do_bench_cudagraph)")
    args = ap.parse_args()
    fl = load_sibling("mla_decode_floor.py", "mla_floor")
    bk = load_sibling("kernels.py", "bench_kernels")
    h128 = load_sibling("mla_decode_h128.py", "mla_h128")
    t0 = time.time()
    fm = build_flashmla(Path(args.flashmla), Path(args.build))
    print(f"FlashMLA dense decode built in {time.time() - t0:.0f} s", flush=True)
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")] if args.cells else CELLS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_gbs = fl.floors(args.rep)["copy_1GiB_GBps"]  # measured in this run: the % copy denominator
    gemm = h128.Gemm()
    res: dict[str, object] = {"copy_GBs": copy_gbs, "flashmla": args.flashmla, "cells": [], "gemms": [gemm()]}
    print(f"copy {copy_gbs:.0f} GB/s, GEMM {res['gemms'][0]['TFLOPs']:.0f} TFLOP/s", flush=True)  # type: ignore[index]
    for H in (int(h) for h in args.heads.split(",")):
        tile = default_decode_tile(H, torch.bfloat16, use_gluon=True, page_size=PAGE)
        q, kv, r2t, rows, lens = h128.paged_inputs(H, PAGE, seed=H)  # 9 requests of mixed lengths, 64-slot pages
        ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, lens, KV_LORA, SCALE)
        errs = {"r3trace": rel_err(mla_decode(q, kv, r2t, rows, lens, KV_LORA, SCALE, 3, tile), ref),
                "flashmla": rel_err(FlashMlaCall(fm, q, kv, r2t, lens)(), ref)}  # fmt: skip
        print(f"H={H} normwise error vs the fp32 reference (mixed lengths): {errs}", flush=True)
        rows_h = []
        for B, L in cells:
            nbytes = B * L * (KV_LORA + ROPE) * 2
            flops = 2 * B * H * L * (KV_LORA + ROPE + KV_LORA)
            q, kv, r2t, rows, lens = bk._decode_inputs(B, L, H)
            kvs = [kv] + [torch.randn_like(kv) for _ in range(fl.copies_for(nbytes) - 1)]
            splits = tile.num_kv_splits(B, H, L, sms)
            # both on each cache copy first: the same inputs give the same answer (bf16 outputs, two roundings)
            agree = rel_err(FlashMlaCall(fm, q, kv, r2t, lens)(),
                            mla_decode(q, kv, r2t, rows, lens, KV_LORA, SCALE, splits, tile))  # fmt: skip
            fns_ours = [partial(mla_decode, q, c, r2t, rows, lens, KV_LORA, SCALE, splits, tile) for c in kvs]
            fns_theirs = [FlashMlaCall(fm, q, c, r2t, lens) for c in kvs]
            # paired, alternating, so drift hits both
            t_ours, t_theirs = [], []
            for _ in range(2):
                t_ours.append(fl.graph_ms(fns_ours, args.rep))
                t_theirs.append(fl.graph_ms(fns_theirs, args.rep))
            ours, theirs = min(t_ours), min(t_theirs)
            row = {"H": H, "B": B, "L": L, "MB": nbytes / 1e6, "r3trace_splits": splits, "r3trace_ms": t_ours,
                   "flashmla_ms": t_theirs, "speedup": theirs / ours, "agree": agree,
                   "r3trace_pct_copy": 100 * nbytes / ours / 1e6 / copy_gbs,
                   "flashmla_pct_copy": 100 * nbytes / theirs / 1e6 / copy_gbs,
                   "r3trace_TFLOPs": flops / ours / 1e9, "flashmla_TFLOPs": flops / theirs / 1e9}  # fmt: skip
            rows_h.append(row)
            res["cells"].append(row)  # type: ignore[attr-defined]
            (out_dir / "mla_decode_flashmla.json").write_text(json.dumps(res, indent=1))
            print(f"H={H} B={B} L={L}: r3trace {ours:.4f} ms ({row['r3trace_pct_copy']:.0f}% of copy, "
                  f"{row['r3trace_TFLOPs']:.0f} TFLOP/s, {splits} splits) | FlashMLA {theirs:.4f} "
                  f"({row['flashmla_pct_copy']:.0f}%, {row['flashmla_TFLOPs']:.0f}) | {row['speedup']:.2f}x | "
                  f"r3trace vs FlashMLA {agree:.1e}", flush=True)  # fmt: skip
            del kvs, q, kv, fns_ours, fns_theirs
            torch.cuda.empty_cache()
        res["gemms"].append(gemm())  # type: ignore[attr-defined]
        top = max(float(g["TFLOPs"]) for g in res["gemms"][-2:])  # type: ignore[index]
        for row in rows_h:
            row["gemm_TFLOPs"] = top
            row["r3trace_pct_gemm"] = 100 * float(row["r3trace_TFLOPs"]) / top
            row["flashmla_pct_gemm"] = 100 * float(row["flashmla_TFLOPs"]) / top
        print(f"H={H}: GEMM {top:.0f} TFLOP/s (the higher of before / after); % GEMM r3trace / FlashMLA: "
              + ", ".join(f"B{r['B']}/{r['L'] // 1024}k {r['r3trace_pct_gemm']:.0f}/{r['flashmla_pct_gemm']:.0f}"
                          for r in rows_h), flush=True)  # fmt: skip
        res[f"errors_H{H}"] = errs
        (out_dir / "mla_decode_flashmla.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
