"""A bench run's result document: where it goes (`--out FILE` where given, else the script's own result file under
bench/results/, and nowhere on a `--smoke` run without `--out`: tests/bench/test_smoke.py runs every script so), and
the record of the machine written beside its figures."""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np


def write_result(doc: dict[str, Any], out: str | None, smoke: bool, default: Path) -> Path | None:
    """doc -> the path it was written to (indented JSON, the line `wrote PATH` printed), or None on a smoke run
    without `out`."""
    path = Path(out) if out else (None if smoke else default)
    if path is not None:
        path.write_text(json.dumps(doc, indent=1))
        print(f"wrote {path}")
    return path


def run_cells(description: str | None, sweep: str, cells_of: Callable[[bool], Sequence[Any]],
              run: Callable[[Any], dict[str, Any]], default: Path) -> list[dict[str, Any]]:
    """A cell bench's command line (`--jobs`, `--smoke`, `--out`): cells_of(smoke)'s cells through run (a module-level
    function: the cells go to `--jobs` processes) -> their results, written as {sweep, args (with the cells' window
    count), machine, results} by write_result."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="one small cell, no file written")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    todo = list(cells_of(args.smoke))
    with ProcessPoolExecutor(args.jobs) as ex:
        results = list(ex.map(run, todo))
    doc = {"sweep": sweep, "args": {**vars(args), "windows": todo[0].spec.windows}, "machine": machine(),
           "results": results}
    write_result(doc, args.out, args.smoke, default)
    return results


def machine() -> dict[str, Any]:
    """What a cell's figures could depend on besides the code, written beside them: greedy swaps and packings break
    near-ties by float rounding, and DeepSeek's policies order tied weights by torch's sort. Ours' forecast once
    summed windows through BLAS, whose kernel OpenBLAS picks per CPU: 74 of 124 cells changed between an AVX2 and
    an AVX-512 machine until forecast.smooth_rates added them up (tests/analysis/test_eplb_blas.py); a cell that differs
    between two runs of one commit is read against this record first."""
    import torch

    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
        simd = [k for k, v in __cpu_features__.items() if v and k in __cpu_dispatch__]
    except ImportError:  # numpy's private table moved: the version still says which kernels could run
        simd = []
    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in (info.read_text().splitlines() if info.exists() else [])
             if ln.startswith("model name")]
    cpu = names[0] if names else platform.processor()
    return {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__, "cpu": cpu,
            "numpy_simd": simd}
