"""Timers and ceilings the kernel benchmarks share (bench/kernels.py and the scripts beside it): do_bench
medians, CUDA-graph replays round-robin over input sets, the copy and GEMM ceilings, and the one results dict
a run writes to $OUT/kernels.json. Imported by name (bench/ is on sys.path when a bench script runs), so every
section of one run shares RESULTS."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from triton.testing import do_bench

L2_BYTES = 60 * 2**20
OUT = Path(os.environ.get("OUT", "out"))
RESULTS: dict[str, object] = {}


def ms(fn: Callable[[], object], rep: int = 100) -> float:
    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def ms_graph(fns: Sequence[Callable[[], object]], rep: int = 100) -> float:
    """Time CUDA-graph replays (launch gaps removed), round-robin over one graph per input set."""
    graphs = []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()  # warm: compile outside capture
    torch.cuda.synchronize()
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    i = [0]

    def replay() -> None:
        graphs[i[0] % len(graphs)].replay()
        i[0] += 1

    return ms(replay, rep)


def rotating(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    i = [0]

    def call() -> object:
        i[0] += 1
        return fns[i[0] % len(fns)]()

    return call


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "kernels.json").write_text(json.dumps(RESULTS, indent=1))


def ceilings() -> tuple[float, float]:
    src = torch.randn(2**28, device="cuda")  # 1 GiB fp32
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 4 / ms(partial(dst.copy_, src)) / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_tflops = 2 * 8192**3 / ms(partial(torch.matmul, a, b)) / 1e9
    RESULTS["ceilings"] = {"copy_GBps": copy_gbs, "gemm_bf16_TFLOPs": gemm_tflops,
                           "device": torch.cuda.get_device_name(), "torch": torch.__version__}  # fmt: skip
    print(f"ceilings: device copy {copy_gbs:.0f} GB/s bf16 GEMM 8192^3 {gemm_tflops:.0f} TFLOP/s")
    del src, dst, a, b
    return copy_gbs, gemm_tflops
