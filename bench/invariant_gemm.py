"""batch_invariant's GEMM (kernels/invariant_matmul.py) on the 2.5B V3 shape's products: each row's bits at M = 1 ..
700 against the rows of one M = 8192 product (the wide 128 x 128 x 64 tile there, the narrow BLOCK_K 128 tiles
below 512 rows), and the time of a product at decode and prefill sizes beside cuBLAS (F.linear) in the same run,
one CUDA-graph replay a call.

Run (H200, about a minute): python -m bench.invariant_gemm --out bench/results/invariant_gemm-h200.json
Smoke (CPU, Triton's interpreter): --smoke checks the bits at a tiny shape, untimed.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.moe_verify_tiles import graph_us
from r3trace.kernels.invariant_matmul import invariant_linear, matmul_tile

# (K, N) of the 2.5B shape: q_a + kv_a, q_b, o_proj, the dense MLP's gate_up and down, the shared expert's gate_up
# and down, the lm_head, kv_a alone
SHAPES = [(2048, 2112), (768, 3072), (2048, 2048), (2048, 11264), (5632, 2048), (2048, 1024), (512, 2048),
          (2048, 32000), (2048, 576)]  # fmt: skip
BIT_ROWS = (1, 3, 17, 33, 64, 200, 511, 512, 700)
TIMED_ROWS = (1, 32, 64, 128, 4096)
FULL_ROWS = 8192


def rows_equal(x: torch.Tensor, w: torch.Tensor, rows: tuple[int, ...]) -> bool:
    """Every product of x's first m rows (m in rows) has the bits of those rows in the product of all of x."""
    full = invariant_linear(x, w)
    return all(torch.equal(invariant_linear(x[:m], w), full[:m]) for m in rows)


def smoke() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=gen).bfloat16()
    w = torch.randn(24, 96, generator=gen).bfloat16()
    assert rows_equal(x, w, (1, 3, 17)), "invariant_linear's rows moved with M"
    print("invariant_gemm smoke: rows equal at M = 1, 3, 17 of 40")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, untimed (make test)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    torch.manual_seed(0)
    rows = []
    for k, n in SHAPES:
        x = torch.randn(FULL_ROWS, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        row: dict[str, object] = {"K": k, "N": n, "bits_equal": rows_equal(x, w, BIT_ROWS)}
        for m in TIMED_ROWS:
            xm = x[:m]
            row[f"M{m}"] = {"invariant_us": round(graph_us(partial(invariant_linear, xm, w)), 1),
                            "cublas_us": round(graph_us(partial(F.linear, xm, w)), 1),
                            "tile": list(matmul_tile(torch.bfloat16, m, n))}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
