"""Kernel benchmarks on one GPU: MLA decode, fused MoE, grouped top-k, each against its ceilings and a
torch baseline measured in the same run. Prints a table per section and writes JSON (and a Markdown
table) under $OUT (or ./out).

Run (GPU): PYTHONPATH=.. python bench/kernels.py [--quick] [--only decode,moe,topk]
Numbers and what they mean: BENCHMARKS.md, "## Kernels (H200)"; each run's notes: bench/NOTES.md.

Timing: triton.testing.do_bench medians (CUDA events) after warm-up. Inputs that would fit in the 60 MB
L2 are rotated among copies (or routes) so each call reads HBM, as serving does. The timers and ceilings
live in bench/timing.py, the MoE sections in bench/moe_bench.py (`moe`) and bench/moe_explore.py
(`moe_explore`); this file holds MLA decode, top-k, the report and the entry point.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from moe_bench import MOE_T, bench_moe
from moe_explore import bench_moe_explore
from timing import L2_BYTES, OUT, RESULTS, ceilings, ms, rotating, save

from r3trace.kernels.mla_decode import DecodeTile, choose_num_kv_splits, default_decode_tile, mla_decode
from r3trace.kernels.topk import grouped_topk, grouped_topk_ref

# ---------------------------------------------------------------- MLA decode
KV_LORA, ROPE, PAGE = 512, 64, 64


def _decode_inputs(B: int, L: int, H: int) -> tuple[torch.Tensor, ...]:
    pages = B * L // PAGE
    perm = torch.randperm(pages, device="cuda")  # shuffled pages: no request is contiguous in memory
    slots = (perm[:, None] * PAGE + torch.arange(PAGE, device="cuda")).reshape(B, L).to(torch.int32)
    kv = torch.randn(pages * PAGE, KV_LORA + ROPE, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, H, KV_LORA + ROPE, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(B, device="cuda")
    lens = torch.full((B,), L, device="cuda", dtype=torch.int64)
    return q, kv, slots, rows, lens


def _naive_decode(q: torch.Tensor, kv: torch.Tensor, r2t: torch.Tensor, scale: float) -> torch.Tensor:
    latent = kv[r2t.long()]  # [B, L, C] gathered
    scores = torch.einsum("bhc,blc->bhl", q, latent).float() * scale
    return torch.einsum("bhl,blc->bhc", scores.softmax(-1).to(q.dtype), latent[..., :KV_LORA])


# DecodeTile(block_h, block_n, num_warps, num_stages[, v_splits, keys_major]); the launcher default per H
# is timed here too, so each table row's tile is compared with its alternatives in the same run
DECODE_TILES = {
    16: [DecodeTile(16, 64, 4, 2), DecodeTile(16, 32, 4, 3), DecodeTile(16, 32, 4, 4)],
    128: [DecodeTile(64, 64, 8, 2), DecodeTile(64, 32, 8, 3), DecodeTile(64, 32, 4, 3, 2), DecodeTile(64, 32, 4, 4, 2)],
}  # fmt: skip
SPLIT_SWEEP = [(16, 32768), (64, 8192), (64, 32768)]  # (B, L) at H = 16: is the split heuristic right?


def bench_decode(copy_gbs: float, gemm_tflops: float, quick: bool) -> None:
    scale = (KV_LORA + ROPE) ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best: dict[int, DecodeTile] = {}
    sweep = {}
    for H in (16, 128):  # time the tiles per H at one mid shape, sync-free (splits from host lengths)
        q, kv, r2t, rows, lens = _decode_inputs(64, 8192, H)
        times = {}
        for tile in DECODE_TILES[H] + [default_decode_tile(H, torch.bfloat16)]:
            try:
                n = tile.num_kv_splits(64, H, 8192, sms)
                fn = partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, scale, num_kv_splits=n, tile=tile)
                times[tile] = ms(fn)
            except Exception as e:  # out of shared memory etc.: recorded, not fatal
                print(f"  tile {tuple(tile)} failed: {type(e).__name__}: {str(e)[:120]}")
        best[H] = min(times, key=lambda k: times[k])
        sweep[H] = {str(tuple(k)): v for k, v in times.items()}
        swept = ", ".join(f"{tuple(k)}: {v:.3f} ms" for k, v in times.items())
        print(f"decode tile sweep H={H} (B=64, L=8k): {swept}")
        del q, kv
    RESULTS["decode_tile_sweep"] = {"best": {str(h): tuple(t) for h, t in best.items()}, "ms": sweep}
    split_rows = []
    for B, L in SPLIT_SWEEP:
        q, kv, r2t, rows, lens = _decode_inputs(B, L, 16)
        auto = choose_num_kv_splits(B, 1, L, sms)
        res = {}
        for n in sorted({auto, 2 * auto, 4 * auto, 8 * auto, 132 // B + 1, 264 // B + 1}):
            if n <= 64:
                res[n] = ms(partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, scale, num_kv_splits=n,
                                    tile=best[16]))  # fmt: skip
        split_rows.append({"B": B, "L": L, "auto": auto, "ms": res})
        print(f"decode splits sweep H=16 B={B} L={L} (auto {auto}): "
              + ", ".join(f"{n}: {t:.3f}" for n, t in res.items()))  # fmt: skip
        del q, kv
    RESULTS["decode_split_sweep"] = split_rows
    rows_out = []
    print(f"{'H':>4} {'B':>4} {'L':>6} {'splits':>6} {'triton ms':>10} {'GB/s':>7} {'%copy':>6} "
          f"{'TFLOP/s':>8} "
          f"{'%gemm':>6} {'naive ms':>9} {'speedup':>7}")  # fmt: skip
    for H in (16, 128):  # the table runs the launcher's defaults: what the engine gets
        # as the engine's backend picks it for a pool of PAGE-slot pages: the Gluon stage 1s on Hopper
        hopper = torch.cuda.get_device_capability()[0] == 9
        tile = default_decode_tile(H, torch.bfloat16, use_gluon=hopper, page_size=PAGE)
        for B in (16, 64, 256):
            for L in (1024, 8192, 32768) if not quick else (8192,):
                q, kv, r2t, rows, lens = _decode_inputs(B, L, H)
                kv_bytes = kv.numel() * 2
                copies = max(1, min(8, math.ceil(4 * L2_BYTES / kv_bytes)))
                kvs = [kv] + [torch.randn_like(kv) for _ in range(copies - 1)]
                # splits from host lengths, as the engine passes them: num_kv_splits=None would add a
                # device sync per call (seq_lens.max()), 0.1-0.2 ms of host gap on this machine (run 3)
                splits = tile.num_kv_splits(B, H, L, sms)
                fns = [partial(mla_decode, q, kv_i, r2t, rows, lens, KV_LORA, scale, num_kv_splits=splits, tile=tile)
                       for kv_i in kvs]  # fmt: skip
                out = fns[0]()
                t = ms(rotating(fns))
                naive = [partial(_naive_decode, q, kv_i, r2t, scale) for kv_i in kvs]
                err = ((out.float() - naive[0]().float()).norm() / naive[0]().float().norm()).item()
                tn = ms(rotating(naive), rep=50)
                gbs = (kv_bytes + q.numel() * 2 + B * H * KV_LORA * 2) / t / 1e6
                tflops = 2 * B * H * L * (KV_LORA + ROPE + KV_LORA) / t / 1e9
                row = {"H": H, "B": B, "L": L, "splits": splits, "tile": list(tile), "ms": t,
                       "GBps": gbs, "pct_copy": 100 * gbs / copy_gbs, "TFLOPs": tflops,
                       "pct_gemm": 100 * tflops / gemm_tflops, "naive_ms": tn,
                       "naive_GBps": kv_bytes / tn / 1e6,
                       "speedup": tn / t, "rel_err_vs_naive": err}  # fmt: skip
                rows_out.append(row)
                print(f"{H:>4} {B:>4} {L:>6} {splits:>6} {t:>10.3f} {gbs:>7.0f} {row['pct_copy']:>5.0f}% "
                      f"{tflops:>8.1f} {row['pct_gemm']:>5.1f}% {tn:>9.3f} {tn / t:>6.1f}x")  # fmt: skip
                del q, kv, kvs, fns, naive
                torch.cuda.empty_cache()
                RESULTS["decode"] = rows_out
                save()


# ---------------------------------------------------------------- grouped top-k
def bench_topk() -> None:
    rows_out = []
    args = (8, "sigmoid", "noaux_tc", 8, 4, True, 2.5)
    bias = torch.randn(256, device="cuda") * 0.1
    print(f"{'T':>6} {'triton ms':>10} {'torch ms':>9} {'speedup':>7}  (V3: E=256, 8 groups, 4 kept, K=8)")
    for T in (1, 64, 1024, 16384):
        logits = torch.randn(T, 256, device="cuda")
        t = ms(partial(grouped_topk, logits, bias, *args))
        tr = ms(partial(grouped_topk_ref, logits, bias, *args))
        same = torch.equal(grouped_topk(logits, bias, *args)[1], grouped_topk_ref(logits, bias, *args)[1])
        rows_out.append({"T": T, "ms": t, "torch_ms": tr, "speedup": tr / t, "ids_equal": same})
        print(f"{T:>6} {t:>10.4f} {tr:>9.4f} {tr / t:>6.1f}x  ids equal: {same}")
    RESULTS["topk"] = rows_out
    save()


def markdown(res: dict) -> str:
    """The BENCHMARKS.md tables from one run's JSON (python bench/kernels.py --report kernels.json)."""
    c = res["ceilings"]
    lines = [f"Ceilings in the same run: device copy {c['copy_GBps']:.0f} GB/s, bf16 GEMM 8192^3 "
             f"{c['gemm_bf16_TFLOPs']:.0f} TFLOP/s ({c['device']}, torch {c['torch']}).", "",
             "| H | B | kv_len | splits | triton ms | GB/s | % copy | TFLOP/s | % GEMM | naive ms | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res.get("decode", []):
        lines.append(f"| {r['H']} | {r['B']} | {r['L']} | {r['splits']} | {r['ms']:.3f} | {r['GBps']:.0f} | "
                     f"{r['pct_copy']:.0f}% | {r['TFLOPs']:.0f} | {r['pct_gemm']:.0f}% | {r['naive_ms']:.3f} | "
                     f"{r['speedup']:.1f}x |")  # fmt: skip
    lines += [
        "",
        "| E | I | T | BM: gate_up / down (bn,bk,g,w,s) | eager ms | graph ms | TFLOP/s | % dense | "
        "loop ms | vs loop | touched-read ms | x read |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def tile(t: list) -> str:  # (bn, bk, g, w, s[, il][, split n]), as BENCHMARKS.md prints them
        flags = ["il"] * bool(t[5]) + [f"split {t[6]}"] * bool(t[6]) + ["tma"] * bool(t[7:8] and t[7])
        return "(" + ", ".join([*map(str, t[:5]), *flags]) + ")"

    for r in res.get("moe", []):
        bm, up, down = r["cfg"]
        srt = " sorted" * bool(r.get("sorted_act"))
        tiles = f"gemv {tuple(r['gemv'])}" if r.get("gemv") else f"{bm}{srt}: {tile(up)} / {tile(down)}"
        lines.append(f"| {r['E']} | {r['I']} | {r['T']} | {tiles} | {r['ms']:.3f} | "
                     f"{r['graph_ms']:.3f} | {r['TFLOPs']:.0f} | {r['pct_dense']:.0f}% | {r['loop_ms']:.2f} | "
                     f"{r['speedup_vs_loop']:.1f}x | {r['touched_read_ms']:.3f} | {r['x_read']:.2f}x |")  # fmt: skip
    lines += [
        "",
        "| E | I | T | align graph ms | torch align graph ms | gate_up ms | down ms | sum ms | dense ms | "
        "same as ref align |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res.get("moe", []):
        lines.append(f"| {r['E']} | {r['I']} | {r['T']} | {r['align_graph_ms']:.4f} | {r['align_ref_graph_ms']:.4f} | "
                     f"{r['gate_up_ms']:.3f} | {r['down_ms']:.3f} | {r['sum_ms']:.3f} | {r['dense_ms']:.3f} | "
                     f"{r['bitwise_same_with_ref_align'] and r['align_equal_ref']} |")  # fmt: skip
    lines += ["", "| T | triton ms | torch ms | speedup | ids equal |", "|---|---|---|---|---|"]
    for r in res.get("topk", []):
        lines.append(f"| {r['T']} | {r['ms']:.4f} | {r['torch_ms']:.4f} | {r['speedup']:.1f}x | {r['ids_equal']} |")
    return "\n".join(lines).replace("| nan |", "| - |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape per section")
    ap.add_argument("--only", default="decode,moe,topk")
    ap.add_argument("--report", help="print the Markdown tables of a saved kernels.json and exit")
    ap.add_argument("--moe-t", default=",".join(map(str, MOE_T)), help="MoE token counts")
    ap.add_argument("--moe-sweep", default="1,1024,4096,16384", help="MoE token counts with a tile sweep ('' none)")
    ap.add_argument("--prewarm", type=int, default=8, help="processes compiling the MoE tiles first (0: off)")
    ap.add_argument("--moe-shapes", default="256x256,32x2048", help="MoE (E x I) shapes, in this order")
    a = ap.parse_args()
    if a.report:
        print(markdown(json.loads(Path(a.report).read_text())))
        return
    moe_ts = [int(t) for t in a.moe_t.split(",")] if not a.quick else [1, 4096]
    sweep_ts = [int(t) for t in a.moe_sweep.split(",") if t]
    shapes = [(int(e), int(i)) for e, i in (s.split("x") for s in a.moe_shapes.split(","))]
    torch.manual_seed(0)
    t0 = time.time()
    copy_gbs, gemm_tflops = ceilings()
    save()
    sections: dict[str, Callable[[], None]] = {
        "topk": bench_topk,
        "decode": partial(bench_decode, copy_gbs, gemm_tflops, a.quick),
        "moe": partial(bench_moe, copy_gbs, moe_ts, sweep_ts, a.prewarm, shapes),
        "moe_explore": partial(bench_moe_explore, copy_gbs, moe_ts, a.prewarm),
    }
    for name in a.only.split(","):
        try:
            sections[name]()
        except Exception:  # one broken section must not cost the others' numbers (device time is scarce)
            traceback.print_exc()
            RESULTS[f"{name}_error"] = traceback.format_exc()[-2000:]
            save()
    (OUT / "kernels.md").write_text(markdown(RESULTS))
    print(f"bench wall time {time.time() - t0:.0f} s; JSON in {OUT / 'kernels.json'}")


if __name__ == "__main__":
    main()
