"""Timers and ceilings the bench scripts share.

A `Timer` is chosen once from the device a script runs on. On a GPU: triton's do_bench medians of eager calls, and
CUDA-graph replays of back-to-back calls (what a kernel costs inside the engine's decode graph; the graph launch is
amortised over the calls). On the CPU (the `--smoke` runs of `make test`, Triton kernels in its interpreter): the
median wall time of a few calls, so every code path of a script runs in CI without claiming a figure.

The ceilings every kernel figure is judged against are measured in the same run: a device copy of 1 GiB (read +
write) and an 8192^3 bf16 GEMM.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

L2_BYTES = 60 * 2**20  # the H200's L2: inputs smaller than 4x this are rotated over copies so each call reads HBM


def copies_for(nbytes: int, at_most: int = 8) -> int:
    """How many copies of an input of nbytes to rotate over so the set spans >= 4x the L2 (at most `at_most`)."""
    return max(1, min(at_most, math.ceil(4 * L2_BYTES / max(nbytes, 1))))


def rotating(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that calls fns in turn, one per call (inputs rotated over copies)."""
    state = {"i": 0}

    def call() -> object:
        state["i"] += 1
        return fns[state["i"] % len(fns)]()

    return call


@dataclass(frozen=True)
class Timer:
    """device "cuda": do_bench / CUDA graphs, rep_ms of timed calls; "cpu": the median of cpu_reps wall timings."""

    device: str = "cuda"
    rep_ms: int = 100
    cpu_reps: int = 2

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"Timer.device {self.device!r} is neither 'cuda' nor 'cpu'")

    def eager_ms(self, fn: Callable[[], object]) -> float:
        """Median ms of one eager call (launch overhead included)."""
        if self.device == "cpu":
            return self._wall_ms([fn])
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=self.rep_ms, return_mode="median"))

    def graph_ms(self, fns: Sequence[Callable[[], object]]) -> float:
        """Median ms per call of one CUDA graph calling fns back to back (one per rotated input set)."""
        if self.device == "cpu":
            return self._wall_ms(fns)
        from triton.testing import do_bench_cudagraph

        torch.cuda.synchronize()  # do_bench_cudagraph's side stream does not wait for the default one

        def each() -> None:
            for fn in fns:
                fn()

        return float(do_bench_cudagraph(each, rep=self.rep_ms, return_mode="median")) / len(fns)

    def _wall_ms(self, fns: Sequence[Callable[[], object]]) -> float:
        for fn in fns:
            fn()  # warm: compile (or interpret) once outside the timing
        times = []
        for _ in range(self.cpu_reps):
            t0 = time.perf_counter()
            for fn in fns:
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / len(fns))
        return statistics.median(times)


@dataclass(frozen=True)
class Ceilings:
    copy_gbs: float  # device copy of `copy_bytes`, read + write, GB/s
    gemm_tflops: float  # bf16 (fp32 on the CPU) square GEMM of side gemm_n, TFLOP/s
    device: str
    torch: str

    def as_dict(self) -> dict[str, float | str]:
        return {"copy_GBps": self.copy_gbs, "gemm_bf16_TFLOPs": self.gemm_tflops, "device": self.device,
                "torch": self.torch}  # fmt: skip


def measure_ceilings(timer: Timer) -> Ceilings:
    """The copy and GEMM ceilings on the timer's device: 1 GiB and 8192^3 bf16 on a GPU, 16 MiB and 256^3 fp32 on
    the CPU (the smoke runs only)."""
    cuda = timer.device == "cuda"
    src = torch.randn(2**28 if cuda else 2**22, device=timer.device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 4 / timer.eager_ms(partial(dst.copy_, src)) / 1e6
    n, dtype = (8192, torch.bfloat16) if cuda else (256, torch.float32)
    a = torch.randn(n, n, device=timer.device, dtype=dtype)
    b = torch.randn(n, n, device=timer.device, dtype=dtype)
    gemm_tflops = 2 * n**3 / timer.eager_ms(partial(torch.matmul, a, b)) / 1e9
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return Ceilings(copy_gbs, gemm_tflops, name, torch.__version__)


def replays_ms(replay: Callable[[], object], n: int = 20) -> float:
    """Mean ms of one of n back-to-back calls of replay (a CUDA graph's), between two CUDA events: the GPU's time
    with the host's launches overlapped."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n
