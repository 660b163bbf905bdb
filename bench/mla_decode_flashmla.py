"""r3trace's MLA decode beside FlashMLA's dense decode, the kernel issue 6's anchor names ("about 3000 GB/s
memory-bound on an H800"): the same cells, the same inputs, the same run (H200).

Run (GPU):  python -m bench.mla_decode_flashmla --flashmla DIR [--heads 16,128] [--cells BxL,...] [--out FILE]
Smoke (CPU): TRITON_INTERPRET=1 python -m bench.mla_decode_flashmla --smoke   (r3trace's side only: FlashMLA is
            CUDA, built from its source on the GPU machine)

DIR: a checkout of deepseek-ai/FlashMLA with its csrc/cutlass submodule's include/ and tools/util/include/ present,
fetched beside the project and never committed (BENCHMARKS.md names both commits). Only its sm90 dense decode is
built (build_flashmla: the scheduling-metadata kernel, the split-KV kernel, the combine kernel, bf16 only), through
torch's cpp_extension with FlashMLA's own nvcc flags for sm_90a; a three-line binding written here exposes its
dense_attn_decode_interface, the function its Python flash_mla_with_kvcache calls. The build needs the CUDA
toolkit's nvcc (the device image has 13.0) and takes minutes.

FlashMLA's call as SGLang's and vLLM's FlashMLA backends make it: q [B, 1, H, 576], the cache viewed as [pages, 64,
1, 576], the block table = each request's page ids (r3trace's shuffled 64-slot pages, so slots // 64), int32 lengths;
the scheduling metadata computed once per batch, outside the timed call (the backends compute it once per forward,
for every layer; r3trace's split count likewise comes from host lengths). Its call allocates its outputs and
partials each time (torch.empty, from the graph's pool when captured). r3trace: mla_decode with the engine's Hopper
tile on 64-slot pages at its own split count. Both timed by bench.timing.Timer.graph_ms (one CUDA graph of
back-to-back calls, median; caches rotated over copies spanning >= 4x the L2 at small cells), after both are
checked against mla_decode_ref. The bf16 GEMM ceiling (8192^3 torch.matmul) is taken before and after each head
count's cells, the % GEMM columns against the higher.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench.inputs import DecodeInputs, paged_decode_inputs, rotated_decode_cell
from bench.mla_decode import CHECK_LENS, Gemm, add_peer_args, parse_cells, rel_err
from bench.timing import Timer, measure_ceilings
from r3trace.kernels.mla_decode import default_decode_tile, mla_decode, mla_decode_ref

PAGE = 64  # FlashMLA's page size
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
    """dense_decode_fwd on r3trace's inputs (q [B, H, 576], the cache [S, 576] of 64-slot pages, the requests'
    req_to_token rows); the scheduling metadata from one untimed call."""

    def __init__(self, fm: ModuleType, inp: DecodeInputs, kv: torch.Tensor, kv_lora: int) -> None:
        B, H, C = inp.q.shape
        self.fm, self.kv_lora, self.scale = fm, kv_lora, C**-0.5
        self.q = inp.q.view(B, 1, H, C)
        self.k = kv.view(-1, PAGE, 1, C)
        # r3trace's pages hold 64 consecutive slots from a multiple of 64: a request's page ids are its slots // 64
        rows = inp.req_to_token[inp.req_pool_indices]  # [B, width] in request order
        self.table = (rows[:, ::PAGE] // PAGE).to(torch.int32).contiguous()
        self.lens = inp.seq_lens.to(torch.int32)
        _, _, self.meta, self.splits = fm.dense_decode_fwd(self.q, self.k, kv_lora, self.lens, self.table, self.scale,
                                                           False, None, None)  # fmt: skip

    def __call__(self) -> torch.Tensor:
        out = self.fm.dense_decode_fwd(self.q, self.k, self.kv_lora, self.lens, self.table, self.scale, False,
                                       self.meta, self.splits)[0]  # fmt: skip
        return out.view(out.shape[0], out.shape[2], self.kv_lora)


def run(args: argparse.Namespace) -> dict[str, Any]:
    timer = Timer(args.device, rep_ms=args.rep, cpu_reps=1)
    fm = None
    if args.flashmla:
        t0 = time.time()
        fm = build_flashmla(Path(args.flashmla), Path(args.build))
        print(f"FlashMLA dense decode built in {time.time() - t0:.0f} s", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if args.device == "cuda" else 4
    copy_gbs = measure_ceilings(timer).copy_gbs  # measured in this run: the % copy denominator
    gemm = Gemm(timer, 8192 if args.device == "cuda" else 128)
    kv_lora, C = args.kv_lora, args.kv_lora + args.rope
    scale = C**-0.5
    res: dict[str, Any] = {"copy_GBs": copy_gbs, "flashmla": args.flashmla, "cells": [], "gemms": [gemm()]}
    print(f"copy {copy_gbs:.0f} GB/s, GEMM {res['gemms'][0]:.0f} TFLOP/s", flush=True)
    for H in args.heads:
        tile = default_decode_tile(H, torch.bfloat16, use_gluon=args.device == "cuda", kv_lora=kv_lora, rope=args.rope,
                                   page_size=PAGE)  # fmt: skip
        gen = torch.Generator().manual_seed(H)
        inp = paged_decode_inputs(args.check_lens, H, kv_lora, args.rope, PAGE, torch.bfloat16, args.device, gen)
        ref = mla_decode_ref(inp.q.float(), inp.kv_cache.float(), *inp[2:], kv_lora, scale)
        errs = {"r3trace": rel_err(mla_decode(*inp, kv_lora, scale, 3, tile), ref)}
        if fm is not None:
            errs["flashmla"] = rel_err(FlashMlaCall(fm, inp, inp.kv_cache, kv_lora)(), ref)
        print(f"H={H} normwise error vs the fp32 reference (mixed lengths): {errs}", flush=True)
        rows_h = []
        for B, L in args.cells:
            cell = rotated_decode_cell(B, L, H, args.device, kv_lora, args.rope, PAGE)
            inp, kvs = cell.inp, cell.caches
            splits = tile.num_kv_splits(B, H, L, sms)
            fns_ours = cell.calls(kv_lora, scale, splits, tile)
            row: dict[str, Any] = {"H": H, "B": B, "L": L, "MB": cell.nbytes / 1e6, "r3trace_splits": splits}
            if fm is None:
                row["r3trace_ms"] = [timer.graph_ms(fns_ours)]
            else:
                # both on the first cache copy: the same inputs give the same answer (bf16 outputs, two roundings)
                row["agree"] = rel_err(FlashMlaCall(fm, inp, inp.kv_cache, kv_lora)(), fns_ours[0]())
                fns_theirs = [FlashMlaCall(fm, inp, c, kv_lora) for c in kvs]
                row["r3trace_ms"], row["flashmla_ms"] = [], []
                for _ in range(2):  # paired, alternating, so drift hits both
                    row["r3trace_ms"].append(timer.graph_ms(fns_ours))
                    row["flashmla_ms"].append(timer.graph_ms(fns_theirs))
                theirs = min(row["flashmla_ms"])
            ours = min(row["r3trace_ms"])
            row["r3trace_pct_copy"], row["r3trace_TFLOPs"] = cell.rates(ours, copy_gbs)
            if fm is not None:
                row["speedup"] = theirs / ours
                row["flashmla_pct_copy"], row["flashmla_TFLOPs"] = cell.rates(theirs, copy_gbs)
            rows_h.append(row)
            res["cells"].append(row)
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=1))
            theirs_txt = (f" | FlashMLA {theirs:.4f} ({row['flashmla_pct_copy']:.0f}%, {row['flashmla_TFLOPs']:.0f}) | "
                          f"{row['speedup']:.2f}x | r3trace vs FlashMLA {row['agree']:.1e}") if fm is not None else ""
            print(f"H={H} B={B} L={L}: r3trace {ours:.4f} ms ({row['r3trace_pct_copy']:.0f}% of copy, "
                  f"{row['r3trace_TFLOPs']:.0f} TFLOP/s, {splits} splits){theirs_txt}", flush=True)
            del kvs, inp, cell
        res["gemms"].append(gemm())
        top = max(res["gemms"][-2:])  # the higher of the GEMM before and after this head count's cells
        for row in rows_h:
            row["gemm_TFLOPs"] = top
            row["r3trace_pct_gemm"] = 100 * row["r3trace_TFLOPs"] / top
            if fm is not None:
                row["flashmla_pct_gemm"] = 100 * row["flashmla_TFLOPs"] / top
        res[f"errors_H{H}"] = errs
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    return res


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flashmla", default="", help="FlashMLA checkout, csrc/ with cutlass headers (but in --smoke)")
    ap.add_argument("--build", default="/tmp/flashmla_build")
    add_peer_args(ap)
    args = ap.parse_args(argv)
    if not args.flashmla and not args.smoke:
        ap.error("--flashmla DIR is required (a deepseek-ai/FlashMLA checkout with csrc/cutlass populated)")
    args.device = "cpu" if args.smoke else "cuda"
    args.kv_lora, args.rope = (32, 16) if args.smoke else (512, 64)
    args.check_lens = [1, 70, 130] if args.smoke else CHECK_LENS
    args.heads = [16] if args.smoke else [int(h) for h in args.heads.split(",")]
    cells = "2x128" if args.smoke else args.cells
    args.cells = parse_cells(cells)
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse(argv))


if __name__ == "__main__":
    main()
