"""r3trace's fused MoE beside SGLang's Triton fused MoE at issue 6's shapes (D = 7168, K = 8, bf16): the same routes,
the same weights, the same run (H200).

Run (GPU): python bench/moe_sglang.py --sglang PATH [--t 1,64,1024,4096,16384] [--shapes 256x256,32x2048]
    -> table on stdout, JSON in $OUT/moe_sglang.json

PATH: SGLang's python/sglang/srt/layers/moe/fused_moe_triton/fused_moe_triton_kernels.py, fetched beside the project
and never committed (bench/NOTES.md names the commit). Its imports of other SGLang modules get stand-ins: quantization
helpers a bf16 call never reaches, and platform probes answering "CUDA, sm_90".

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
import json
import os
import sys
import types
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton.language as tl
from sibling import load_path  # bench/sibling.py: python bench/<script>.py puts bench/ on the path
from timing import ms, ms_graph, rotating

from r3trace.kernels.moe.align import MoeAlignment, moe_align
from r3trace.kernels.moe.fused_moe import fused_moe, fused_moe_ref

D, K = 7168, 8
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
    """The kernels file as a module; stand-ins for the SGLang modules it imports."""

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
    return load_path(Path(path), "sglang_fused_moe_kernels")


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang", required=True, help="SGLang's fused_moe_triton/fused_moe_triton_kernels.py")
    ap.add_argument("--t", default="1,64,1024,4096,16384")
    ap.add_argument("--shapes", default="256x256,32x2048", help="E x I")
    args = ap.parse_args()
    sg = load_sglang(args.sglang)
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ts = [int(t) for t in args.t.split(",")]
    res: dict[str, object] = {"sglang": args.sglang, "rows": []}
    for E, I in ((int(e), int(i)) for e, i in (s.split("x") for s in args.shapes.split(","))):
        w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) / D**0.5
        w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) / I**0.5
        tmax = max(ts)
        bufs = {"c1": torch.empty(tmax * K, 2 * I, device="cuda", dtype=torch.bfloat16),
                "c2": torch.empty(tmax * K, I, device="cuda", dtype=torch.bfloat16),
                "c3": torch.empty(tmax * K, D, device="cuda", dtype=torch.bfloat16),
                "out": torch.empty(tmax, D, device="cuda", dtype=torch.bfloat16)}  # fmt: skip
        for T in ts:
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            sets = 8 if T <= 64 else 1
            ids_sets = [torch.rand(T, E, device="cuda").topk(K, dim=-1).indices.to(torch.int32) for _ in range(sets)]
            wts = torch.rand(T, K, device="cuda")
            ref = fused_moe_ref(x, w13, w2, ids_sets[0], wts)
            ours_fns = [partial(fused_moe, x, w13, w2, ids, wts) for ids in ids_sets]
            row: dict[str, Any] = {"E": E, "I": I, "T": T, "r3trace_err": rel_err(ours_fns[0](), ref),
                                   "r3trace_ms": ms(rotating(ours_fns)), "sglang": {}}  # fmt: skip
            variants: dict[str, tuple[tuple[int, ...], bool]] = {}
            for cfg in CANDIDATES[t_class(T)]:
                for tma in (False, True) if cfg[0] >= 64 else (False,):
                    fns = [partial(sglang_call, sg, x, w13, w2, wts, cfg, tma, bufs, ids) for ids in ids_sets]
                    key = f"{cfg}{' tma' * tma}"
                    variants[key] = (cfg, tma)
                    try:
                        err = rel_err(fns[0](), ref)  # sglang_call aligns inside, as r3trace's fused_moe does
                        row["sglang"][key] = {"ms": ms(rotating(fns)), "err": err}
                    except Exception as e:  # a config this Triton cannot build: reported, not fatal
                        row["sglang"][key] = {"failed": f"{type(e).__name__}: {str(e)[:160]}"}
            timed = {k: v["ms"] for k, v in row["sglang"].items() if "ms" in v}
            best = min(timed, key=timed.__getitem__)
            row["sglang_best"], row["sglang_best_ms"] = best, timed[best]
            row["speedup"] = timed[best] / row["r3trace_ms"]
            if T <= 1024:  # decode sizes: both as CUDA-graph replays too (the engine and SGLang decode from graphs)
                cfg, tma = variants[best]
                row["r3trace_graph_ms"] = ms_graph(ours_fns)
                row["sglang_graph_ms"] = ms_graph([partial(sglang_call, sg, x, w13, w2, wts, cfg, tma, bufs, ids)
                                                   for ids in ids_sets])  # fmt: skip
            flops = 2 * T * K * 3 * I * D
            row["r3trace_TFLOPs"], row["sglang_TFLOPs"] = flops / row["r3trace_ms"] / 1e9, flops / timed[best] / 1e9
            dense_w = torch.randn(D, 3 * K * I, device="cuda", dtype=torch.bfloat16)  # the goal's dense GEMM
            row["dense_ms"] = ms(partial(torch.matmul, x, dense_w))
            row["r3trace_pct_dense"] = 100 * row["dense_ms"] / row["r3trace_ms"]
            row["sglang_pct_dense"] = 100 * row["dense_ms"] / timed[best]
            del dense_w
            res["rows"].append(row)  # type: ignore[attr-defined]
            print(f"E={E} I={I} T={T}: r3trace {row['r3trace_ms']:.4f} ms (err {row['r3trace_err']:.1e}) | sglang best "
                  f"{timed[best]:.4f} {best} (err {row['sglang'][best]['err']:.1e}) | {row['speedup']:.2f}x | % dense "
                  f"{row['r3trace_pct_dense']:.0f} / {row['sglang_pct_dense']:.0f}"
                  + (f" | graph {row['r3trace_graph_ms']:.4f} vs {row['sglang_graph_ms']:.4f}" if T <= 1024 else "")
                  + " | " + " ".join(f"{k}: {v:.4f}" for k, v in timed.items()), flush=True)  # fmt: skip
            (out_dir / "moe_sglang.json").write_text(json.dumps(res, indent=1, default=str))
        del w13, w2, bufs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
