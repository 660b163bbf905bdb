"""r3trace's fused MoE beside SGLang's Triton fused MoE at issue 6's shapes (D = 7168, K = 8, bf16): the same routes,
the same weights, the same run (H200).

Run (GPU):  python -m bench.moe_sglang --sglang PATH [--t 1,64,1024,4096,16384] [--shapes 256x256,32x2048]
Smoke (CPU): TRITON_INTERPRET=1 python -m bench.moe_sglang --smoke   (r3trace's side only: SGLang's kernels need its
            file)

PATH: SGLang's python/sglang/srt/layers/moe/fused_moe_triton/fused_moe_triton_kernels.py, fetched beside the project
and never committed (BENCHMARKS.md names the commit measured). Its imports of other SGLang modules get stand-ins:
quantization helpers a bf16 call never reaches, and platform probes answering "CUDA, sm_90".

SGLang's pipeline, as its fused_experts runs it for bf16:
1. the align at its BLOCK_M. SGLang's own is a CUDA op (sgl_kernel), so this uses r3trace's moe_align. Its output is
   the layout SGLang's kernel reads: pair ids sorted by expert, padded with M; the expert of each block; the rows used.
2. invoke_fused_moe_kernel for gate_up into [T, K, 2I];
3. act_and_mul_triton (SiLU and mul) into [T K, I];
4. invoke_fused_moe_kernel for down, with the routed weights, into [T, K, D];
5. moe_sum_reduce_triton into [T, D].

Configs: SGLang ships no bf16 H200 table for E = 256 / N = 256 or E = 32 / N = 2048 (only fp8 ones, and bf16 for
E = 512 / N = 256). So each CANDIDATES config is timed at each T, the larger tiles also with TMA weight descriptors
(b_use_tma), and the fastest pipeline is kept: SGLang's best case among them, as its tuning script would pick. Both
pipelines are eager do_bench medians over rotated route sets (8 sets at T <= 64, so the touched weights are not
L2-resident), and CUDA-graph replays at T <= 1024. Both are checked against fused_moe_ref (normwise).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton.language as tl

from bench.inputs import moe_routes
from bench.timing import Timer, rotating
from r3trace.kernels.moe import fused_moe, fused_moe_ref
from r3trace.kernels.moe.align import MoeAlignment, moe_align

K = 8
# (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages): SGLang's bf16 H200 table for
# E = 512 / N = 256 (the nearest it ships) per T class, plus larger tiles at large T
CANDIDATES: dict[str, list[tuple[int, int, int, int, int, int]]] = {
    "small": [(16, 64, 64, 1, 4, 5), (16, 128, 64, 1, 4, 3), (16, 64, 64, 16, 4, 3), (16, 128, 128, 1, 8, 3),
              (16, 256, 128, 1, 8, 2)],
    "mid": [(16, 128, 128, 1, 8, 3), (32, 128, 64, 1, 4, 3), (64, 128, 64, 16, 8, 3), (64, 64, 64, 1, 4, 3)],
    "large": [(64, 128, 64, 16, 8, 3), (128, 128, 64, 16, 8, 3), (128, 256, 64, 16, 8, 3), (128, 128, 128, 16, 8, 3),
              (64, 256, 64, 1, 8, 3)],
}  # fmt: skip


def t_class(T: int) -> str:
    return "small" if T <= 64 else "mid" if T <= 1024 else "large"


def load_sglang(path: str) -> types.ModuleType:
    """The kernels file (a peer's file given on the command line) as a module; stand-ins for the SGLang modules it
    imports."""

    def unused(*_: object, **__: object) -> Any:
        raise RuntimeError("quantization helper reached on a bf16 call")

    stubs: dict[str, dict[str, Any]] = {
        "sglang.srt.batch_invariant_ops": {"is_batch_invariant_mode_enabled": lambda: False},
        "sglang.srt.layers.moe.utils": {"get_moe_padding_size": lambda *_: 0},
        "sglang.srt.layers.quantization.fp8_kernel": dict.fromkeys(
            ("per_token_group_quant_fp8", "scaled_fp8_quant", "sglang_per_token_group_quant_fp8"), unused),
        "sglang.srt.layers.quantization.int8_kernel": dict.fromkeys(
            ("per_token_group_quant_int8", "per_token_quant_int8", "sglang_per_token_group_quant_int8"), unused),
        "sglang.srt.utils": {"cpu_has_amx_support": lambda: False, "get_bool_env_var": lambda *_: False,
                             "is_cpu": lambda: False, "is_cuda": lambda: True, "is_hip": lambda: False,
                             "is_sm90_supported": lambda: True},
    }  # fmt: skip
    for name, attrs in stubs.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        mod = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(mod, k, v)
        sys.modules[name] = mod
    spec = importlib.util.spec_from_file_location("sglang_fused_moe_kernels", Path(path))
    if spec is None or spec.loader is None:
        raise SystemExit(f"--sglang {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sglang_moe(
    sg: types.ModuleType, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
    al: MoeAlignment, cfg: tuple[int, ...], tma: bool, bufs: dict[str, torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """SGLang's bf16 fused_experts steps 2-5 on a given alignment (at cfg's BLOCK_SIZE_M)."""
    bm, bn, bk, g, w, s = cfg
    config = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": g, "num_warps": w,
              "num_stages": s}  # fmt: skip
    T = x.shape[0]
    c1, c2, c3, out = bufs["c1"][: T * K], bufs["c2"][: T * K], bufs["c3"][: T * K], bufs["out"][:T]
    common = dict(compute_type=tl.bfloat16, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                  use_int4_w4a16=False, per_channel_quant=False, b_use_tma=tma)  # fmt: skip
    sg.invoke_fused_moe_kernel(x, w13, None, c1.view(T, K, -1), None, None, None, wts, ids, al.sorted_ids,
                               al.block_expert, al.num_padded, False, K, config, **common)  # fmt: skip
    sg.act_and_mul_triton(c1, c2, config, topk_ids=ids)
    sg.invoke_fused_moe_kernel(c2, w2, None, c3.view(T, K, -1), None, None, None, wts, ids, al.sorted_ids,
                               al.block_expert, al.num_padded, True, 1, config, **common)  # fmt: skip
    sg.moe_sum_reduce_triton(c3.view(T, K, -1), out, 1.0)
    return out


def sglang_call(
    sg: types.ModuleType, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, wts: torch.Tensor,
    cfg: tuple[int, ...], tma: bool, bufs: dict[str, torch.Tensor], ids: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The whole SGLang pipeline, the align included (as r3trace's fused_moe includes its own)."""
    return sglang_moe(sg, x, w13, w2, ids, wts, moe_align(ids, w13.shape[0], cfg[0]), cfg, tma, bufs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.float() - ref.float()).norm() / ref.float().norm()).item())


def run(args: argparse.Namespace) -> dict[str, Any]:
    timer = Timer(args.device, cpu_reps=1)
    dev, D = args.device, args.hidden
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    sg = load_sglang(args.sglang) if args.sglang else None
    res: dict[str, Any] = {"sglang": args.sglang, "rows": []}
    for E, I in args.shapes:
        gen = torch.Generator(device=dev).manual_seed(0)
        w13 = (torch.randn(E, 2 * I, D, device=dev, generator=gen) / D**0.5).to(dtype)
        w2 = (torch.randn(E, D, I, device=dev, generator=gen) / I**0.5).to(dtype)
        tmax = max(args.t)
        bufs = {"c1": torch.empty(tmax * K, 2 * I, device=dev, dtype=dtype),
                "c2": torch.empty(tmax * K, I, device=dev, dtype=dtype),
                "c3": torch.empty(tmax * K, D, device=dev, dtype=dtype),
                "out": torch.empty(tmax, D, device=dev, dtype=dtype)}  # fmt: skip
        for T in args.t:
            x = torch.randn(T, D, device=dev, generator=gen).to(dtype)
            sets = 8 if T <= 64 and dev == "cuda" else 1
            ids_sets = [moe_routes(T, E, K, dev, gen) for _ in range(sets)]
            wts = torch.rand(T, K, device=dev, generator=gen)
            ref = fused_moe_ref(x, w13, w2, ids_sets[0], wts)
            ours_fns = [partial(fused_moe, x, w13, w2, ids, wts) for ids in ids_sets]
            row: dict[str, Any] = {"E": E, "I": I, "T": T, "r3trace_err": rel_err(ours_fns[0](), ref),
                                   "r3trace_ms": timer.eager_ms(rotating(ours_fns)), "sglang": {}}  # fmt: skip
            flops = 2 * T * K * 3 * I * D
            row["r3trace_TFLOPs"] = flops / row["r3trace_ms"] / 1e9
            dense_w = torch.randn(D, 3 * K * I, device=dev, dtype=dtype)  # the goal's dense GEMM
            row["dense_ms"] = timer.eager_ms(partial(torch.matmul, x, dense_w))
            row["r3trace_pct_dense"] = 100 * row["dense_ms"] / row["r3trace_ms"]
            del dense_w
            if T <= 1024 and dev == "cuda":  # decode sizes: CUDA-graph replays too (both engines decode from graphs)
                row["r3trace_graph_ms"] = timer.graph_ms(ours_fns)
            if sg is not None:
                sglang_row(sg, row, timer, x, w13, w2, wts, ids_sets, ref, bufs, flops)
            res["rows"].append(row)
            theirs = (f" | sglang best {row['sglang_best_ms']:.4f} {row['sglang_best']} | {row['speedup']:.2f}x | "
                      f"% dense {row['sglang_pct_dense']:.0f}") if sg is not None else ""
            print(f"E={E} I={I} T={T}: r3trace {row['r3trace_ms']:.4f} ms (err {row['r3trace_err']:.1e}, "
                  f"{row['r3trace_pct_dense']:.0f}% dense){theirs}", flush=True)  # fmt: skip
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=1, default=str))
        del w13, w2, bufs
    return res


def sglang_row(
    sg: types.ModuleType, row: dict[str, Any], timer: Timer, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    wts: torch.Tensor, ids_sets: list[torch.Tensor], ref: torch.Tensor, bufs: dict[str, torch.Tensor], flops: int,
) -> None:  # fmt: skip
    """SGLang's pipeline at every candidate config (TMA weights too where BLOCK_M >= 64), the fastest kept."""
    T = x.shape[0]
    variants: dict[str, tuple[tuple[int, int, int, int, int, int], bool]] = {}  # key -> (CANDIDATES config, tma)
    for cfg in CANDIDATES[t_class(T)]:
        for tma in (False, True) if cfg[0] >= 64 else (False,):
            fns = [partial(sglang_call, sg, x, w13, w2, wts, cfg, tma, bufs, ids) for ids in ids_sets]
            key = f"{cfg}{' tma' * tma}"
            variants[key] = (cfg, tma)
            try:
                err = rel_err(fns[0](), ref)  # sglang_call aligns inside, as r3trace's fused_moe does
                row["sglang"][key] = {"ms": timer.eager_ms(rotating(fns)), "err": err}
            except Exception as e:  # a config this Triton cannot build: reported, not fatal
                row["sglang"][key] = {"failed": f"{type(e).__name__}: {str(e)[:160]}"}
    timed = {k: v["ms"] for k, v in row["sglang"].items() if "ms" in v}
    best = min(timed, key=timed.__getitem__)
    row["sglang_best"], row["sglang_best_ms"] = best, timed[best]
    row["speedup"] = timed[best] / row["r3trace_ms"]
    row["sglang_TFLOPs"] = flops / timed[best] / 1e9
    row["sglang_pct_dense"] = 100 * row["dense_ms"] / timed[best]
    if "r3trace_graph_ms" in row:
        cfg, tma = variants[best]
        row["sglang_graph_ms"] = timer.graph_ms([partial(sglang_call, sg, x, w13, w2, wts, cfg, tma, bufs, ids)
                                                 for ids in ids_sets])  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang", default="", help="SGLang's fused_moe_triton/fused_moe_triton_kernels.py (but --smoke)")
    ap.add_argument("--t", default="1,64,1024,4096,16384")
    ap.add_argument("--shapes", default="256x256,32x2048", help="E x I")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, r3trace's side only (make test)")
    args = ap.parse_args(argv)
    if not args.sglang and not args.smoke:
        ap.error("--sglang PATH is required (SGLang's fused_moe_triton/fused_moe_triton_kernels.py)")
    args.device = "cpu" if args.smoke else "cuda"
    args.hidden = 64 if args.smoke else 7168
    shapes, ts = ("16x32", "5") if args.smoke else (args.shapes, args.t)
    args.shapes = [(int(e), int(i)) for e, i in (s.split("x") for s in shapes.split(","))]
    args.t = [int(t) for t in ts.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse(argv))


if __name__ == "__main__":
    main()
