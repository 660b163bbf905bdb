"""Kernel benchmarks on one GPU: MLA decode, fused MoE, grouped top-k, each against its ceilings and a
torch baseline measured in the same run. Prints a table per section and writes JSON (and a Markdown
table) under $OUT (or ./out).

Run (GPU): PYTHONPATH=.. python bench/kernels.py [--quick] [--only decode,moe,topk]
Numbers and what they mean: BENCHMARKS.md, "## Kernels (H200)"; each run's notes: bench/NOTES.md.

Timing: triton.testing.do_bench medians (CUDA events) after warm-up. Inputs that would fit in the 60 MB
L2 are rotated among copies (or routes) so each call reads HBM, as serving does.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import torch
from triton.testing import do_bench

from r3trace.kernels.fused_moe import (
    GemmTile,
    GemvTile,
    MoeConfig,
    fused_moe,
    fused_moe_ref,
    grouped_config,
    moe_config,
    moe_down,
    moe_gate_up,
    moe_sum,
)
from r3trace.kernels.mla_decode import DecodeTile, choose_num_kv_splits, default_decode_tile, mla_decode
from r3trace.kernels.moe_align import moe_align, moe_align_ref
from r3trace.kernels.moe_gemv import gemv_down_sum, gemv_gate_up
from r3trace.kernels.topk import grouped_topk, grouped_topk_ref

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
        # as the engine's backend picks it: the Gluon stage 1 at H >= 64 on Hopper
        tile = default_decode_tile(H, torch.bfloat16, use_gluon=torch.cuda.get_device_capability()[0] == 9)
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


# ---------------------------------------------------------------- fused MoE
D, K = 7168, 8
DEV = "cuda"  # bench/kernels.py's MoE part also runs on CPU under TRITON_INTERPRET=1 as a smoke test
MOE_T = (1, 16, 64, 256, 1024, 4096, 16384)
MOE_SHAPES = ((256, 256), (32, 2048))  # (E, I): V3 per rank under TP8 and under EP8
# Tiles swept per GEMM (gate_up and down timed apart on one alignment, best of each composed), at the
# launcher's BLOCK_M. Shared memory per stage: gate_up (BM + 2 BN) * BK * 2 B, down (BM + BN) * BK * 2 B;
# the H200 allows 227 KB. GemmTile = (block_n, block_k, group_m, num_warps, num_stages[, interleave
# gate/up into one product][, n_split]). Run 1's lists and times: bench/NOTES.md, "Fused MoE".
# run 2: the n_split down (whole K = I <= 256 in one tile, programs walk N; swept only where I <= block_k)
# and the run-1 winners, at the T of each tier
UP_TILES = {
    16: [GemmTile(32, 256, 1, 4, 3), GemmTile(32, 256, 1, 4, 3, True), GemmTile(16, 512, 1, 4, 3)],
    32: [GemmTile(64, 128, 4, 4, 4), GemmTile(128, 64, 4, 4, 4, True), GemmTile(64, 128, 4, 4, 3, True)],
    64: [GemmTile(256, 64, 8, 8, 3), GemmTile(128, 64, 8, 4, 4, True)],
    128: [GemmTile(128, 64, 8, 8, 3, True), GemmTile(128, 64, 8, 8, 4, True), GemmTile(128, 64, 8, 8, 3)],
}  # fmt: skip
# session 4 (large T): weights through TMA descriptors (interleaved: one [1, BN, 2, BK] box; plain: two boxes)
UP_TILES[128] = [GemmTile(128, 64, 8, 8, 3, True), GemmTile(128, 64, 8, 8, 3, True, tma=True),
                 GemmTile(128, 64, 8, 8, 4, True, tma=True), GemmTile(128, 64, 8, 8, 3, tma=True),
                 GemmTile(128, 64, 8, 8, 4, tma=True)]  # fmt: skip
DOWN_TILES = {
    16: [GemmTile(64, 128, 1, 4, 4), GemmTile(64, 256, 1, 4, 3, n_split=16), GemmTile(32, 256, 1, 4, 4, n_split=32),
         GemmTile(128, 256, 1, 4, 2, n_split=8)],
    32: [GemmTile(64, 128, 4, 4, 4), GemmTile(128, 128, 4, 4, 3), GemmTile(64, 256, 4, 4, 3, n_split=8)],
    64: [GemmTile(256, 64, 8, 8, 3), GemmTile(128, 64, 8, 4, 4), GemmTile(64, 256, 8, 4, 3, n_split=4)],
    128: [GemmTile(256, 64, 8, 8, 3), GemmTile(64, 256, 8, 8, 3, n_split=4), GemmTile(64, 256, 8, 8, 3, n_split=8),
          GemmTile(128, 256, 8, 8, 2, n_split=4), GemmTile(64, 256, 8, 4, 3, n_split=8)],
}  # fmt: skip
DOWN_TILES[128] = [GemmTile(256, 64, 8, 8, 3), GemmTile(256, 64, 8, 8, 3, tma=True),
                   GemmTile(256, 64, 8, 8, 4, tma=True),
                   GemmTile(64, 256, 8, 8, 3, n_split=4), GemmTile(64, 256, 8, 8, 3, n_split=4, tma=True),
                   GemmTile(128, 256, 8, 8, 2, n_split=4, tma=True)]  # fmt: skip
# act at the sorted positions (MoeConfig.sorted_act) changes the gate_up's store and the down's A: swept as
# both values at BLOCK_M 128, each GEMM's best composed per value
SORTED_SWEEP = {128: (False, True)}


def _routes(T: int, E: int, sets: int) -> list[torch.Tensor]:
    return [torch.rand(T, E, device=DEV).topk(K, dim=-1).indices.to(torch.int32) for _ in range(sets)]


def _sweep_bms(T: int, E: int) -> list[int]:
    return [moe_config(T * K, E).block_m]


def _prewarm_job(job: tuple[int, GemmTile, str, int, str, int, bool]) -> str:
    """Compile one (BLOCK_M, tile, GEMM, T-class, act order) into Triton's disk cache in a worker process. E, I
    and T do not enter the kernel's cache key here (all sizes are multiples of 16 except M = 8 at T = 1)."""
    bm, tile, part, T, dev, D, srt = job
    E, I = 8, 256
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    ids = _routes(T, E, 1)[0]
    align = moe_align(ids, E, bm)
    if part == "up":
        w13 = torch.randn(E, 2 * I, D, device=dev, dtype=torch.bfloat16)
        moe_gate_up(x, w13, align, K, bm, tile, srt)
    else:
        act = torch.randn(align.sorted_ids.shape[0] if srt else T * K, I, device=dev, dtype=torch.bfloat16)
        w2 = torch.randn(E, D, I, device=dev, dtype=torch.bfloat16)
        moe_down(act, w2, align, torch.rand(T, K, device=dev), bm, tile, srt, T * K)
    if dev == "cuda":
        torch.cuda.synchronize()
    return f"{bm} {part} {tuple(tile)} T={T} sorted={srt}"


def prewarm(ts: Sequence[int], sweep_ts: Sequence[int], workers: int, shapes: Sequence[tuple[int, int]]) -> None:
    """Compile every tile this run will time in parallel processes (~2 s per GEMM compile, ~40 of them:
    serially most of a device call). Failures only cost the parallelism."""
    jobs = set()
    for T in ts:
        for E, I in shapes:
            cfg = moe_config(T * K, E, 2, I, tokens=T)
            tc = 1 if T == 1 else 64
            base = _baseline_config(T, E, I)
            todo = [(c.block_m, t, p, c.sorted_act) for c in (cfg, base, *_extras(cfg, I))
                    for t, p in ((c.gate_up, "up"), (c.down, "down"))]  # fmt: skip
            for bm in _sweep_bms(T, E) if T in sweep_ts else []:
                for srt in SORTED_SWEEP.get(bm, (False,)):
                    todo += [(bm, t, "up", srt) for t in UP_TILES[bm]]
                    todo += [(bm, t, "down", srt) for t in DOWN_TILES[bm] if t.n_split == 0 or t.block_k >= I]
            jobs |= {(bm, tile, part, tc, DEV, D, srt) for bm, tile, part, srt in todo}
    _prewarm_pool(_prewarm_job, sorted(jobs, key=str), workers)


def _prewarm_pipe(job: tuple[MoeConfig, int, int]) -> str:
    """Compile one whole pipeline (align, GEMMs or gemv kernels, sum) at T tokens and I in a worker."""
    cfg, T, I = job
    E = 8
    x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, D, device=DEV, dtype=torch.bfloat16)
    w2 = torch.randn(E, D, I, device=DEV, dtype=torch.bfloat16)
    fused_moe(x, w13, w2, _routes(T, E, 1)[0], torch.rand(T, K, device=DEV), config=cfg)
    if DEV == "cuda":
        torch.cuda.synchronize()
    return f"{_cfg_str(cfg)} T={T} I={I}"


def _prewarm_pool(fn: Callable[[tuple], str], jobs: Sequence[tuple], workers: int) -> None:
    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for job, fut in [(j, pool.submit(fn, j)) for j in jobs]:
            try:
                fut.result(timeout=300)
            except Exception as e:  # out of shared memory etc.: the timed run reports it again
                print(f"  prewarm {job} failed: {type(e).__name__}: {str(e)[:100]}")
    print(f"prewarm: {len(jobs)} jobs in {time.time() - t0:.0f} s on {workers} processes")


def _parts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids_sets: list[torch.Tensor],
           wts: torch.Tensor, bm: int, up_tiles: list[GemmTile], down_tiles: list[GemmTile],
           E: int, srt: bool = False) -> dict[str, dict[GemmTile, float]]:  # fmt: skip
    """Each GEMM's time per tile on the same alignments (rotated over route sets); srt: act in sorted order."""
    aligns = [moe_align(ids, E, bm) for ids in ids_sets]
    act = moe_gate_up(x, w13, aligns[0], K, bm, up_tiles[0], srt)
    M = ids_sets[0].numel()
    out: dict[str, dict[GemmTile, float]] = {"up": {}, "down": {}}
    for part, tiles in (("up", up_tiles), ("down", down_tiles)):
        for tile in tiles:
            if part == "up":
                fns = [partial(moe_gate_up, x, w13, a, K, bm, tile, srt) for a in aligns]
            else:
                fns = [partial(moe_down, act, w2, a, wts, bm, tile, srt, M) for a in aligns]
            try:
                out[part][tile] = ms(rotating(fns))
            except Exception as e:
                print(f"  bm {bm} {part} {tuple(tile)} failed: {type(e).__name__}: {str(e)[:120]}")
    return out


def _extras(default: MoeConfig, I: int) -> list[MoeConfig]:
    """Pipelines timed beside a BLOCK_M 128 default: session 4 run 1's near-ties (act sorted, a 4-stage gate_up)
    and, at I <= 256, BLOCK_M 64 (padding 1.25x instead of 1.5x at E = 256 / 4k) with the TMA weights."""
    if default.block_m != 128 or default.gemv is not None:
        return []
    out = [default._replace(sorted_act=True), default._replace(gate_up=default.gate_up._replace(num_stages=4))]
    if I <= 256:
        up, down = GemmTile(128, 64, 8, 4, 4, True, tma=True), GemmTile(64, 256, 8, 4, 3, n_split=4, tma=True)
        out += [MoeConfig(64, up, down)]
    return out


def _read_once(*ts: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor read once by a reduction (no write): the weight-streaming floor of a grouped GEMM."""
    return [t.amax() for t in ts]


def _cfg_str(c: MoeConfig) -> str:
    if c.gemv is not None:
        return f"gemv {tuple(c.gemv)}"
    return f"{c.block_m}{' sorted' * c.sorted_act}: {tuple(c.gate_up)} / {tuple(c.down)}"


def _baseline_config(T: int, E: int, I: int) -> MoeConfig:
    """The baseline timed in the same run as every row: at BLOCK_M 128 (T >= 4k at both shapes) the tiles
    committed before session 4 (cdd240e); below it the defaults before session 3's gemv work (5267bf3): gemv
    (4 rows x 1024, 4 warps; down 4 rows x 256, 4 warps; runtime loops) at T = 1 where I <= 256, else grouped."""
    grouped = grouped_config(T * K, E, 2, I)
    if grouped.block_m == 128:  # session 4 baseline: the BLOCK_M 128 tier as committed before it (cdd240e)
        down = GemmTile(64, 256, 8, 8, 3, n_split=4) if I <= 256 else GemmTile(256, 64, 8, 8, 3)
        return MoeConfig(128, GemmTile(128, 64, 8, 8, 3, True), down)
    return grouped._replace(gemv=GemvTile(4, 1024, 4, 4, 256, 4)) if T == 1 and I <= 256 else grouped


# ---- exploration (--only moe_explore): candidates graph-timed per (E, I, T), each checked against the ref
# GemvTile(up_n, up_k, up_warps, down_n, down_k, down_warps, up_stages, down_stages); at T = 1 the up and
# down kernels are graph-timed apart per tile and the best of each composed
GEMV_TILES = [
    GemvTile(8, 512, 4, 16, 256, 4), GemvTile(4, 512, 4, 8, 256, 4), GemvTile(4, 1024, 4, 32, 256, 8),
    GemvTile(16, 512, 8, 16, 512, 8), GemvTile(8, 1024, 8, 8, 512, 4), GemvTile(2, 1024, 4, 4, 256, 4),
    GemvTile(8, 512, 4, 16, 256, 4, 3, 3), GemvTile(4, 256, 4, 16, 128, 4, 4, 4),
]  # fmt: skip


def _explore_cands(T: int, E: int, I: int, best_gemv: GemvTile | None) -> list[MoeConfig]:
    base = _baseline_config(T, E, I)
    cands = [base]
    if T <= 16:
        g = [moe_config(T * K, E, 2, I)._replace(gemv=GEMV_TILES[0])]
        g += [base._replace(gemv=best_gemv)] if best_gemv is not None and best_gemv != GEMV_TILES[0] else []
        cands += g
    if E == 32 and T >= 64:  # fewer, larger M blocks: weights read by fewer programs, wgmma from BLOCK_M 64
        cands += [
            MoeConfig(32, GemmTile(64, 128, 4, 4, 4), GemmTile(64, 128, 4, 4, 4)),
            MoeConfig(64, GemmTile(256, 64, 8, 8, 3), GemmTile(128, 64, 8, 4, 4)),
            MoeConfig(64, GemmTile(128, 64, 8, 4, 4, True), GemmTile(128, 64, 8, 4, 4)),
            MoeConfig(64, GemmTile(128, 64, 8, 8, 3, True), GemmTile(256, 64, 8, 8, 3)),
            MoeConfig(128, GemmTile(128, 64, 8, 8, 3, True), GemmTile(256, 64, 8, 8, 3)),
        ]  # fmt: skip
    return list(dict.fromkeys(cands))


def bench_moe_explore(copy_gbs: float, ts: Sequence[int], workers: int) -> None:
    if workers > 0:
        jobs = {(c, min(T, 2), I) for T in ts for E, I in MOE_SHAPES
                for c in _explore_cands(T, E, I, None) + [MoeConfig(16, *_baseline_config(1, E, I)[1:3], g)
                                                        for g in GEMV_TILES]}  # fmt: skip
        _prewarm_pool(_prewarm_pipe, sorted(jobs, key=str), workers)
    out = []
    for E, I in MOE_SHAPES:
        w13 = torch.randn(E, 2 * I, D, device=DEV, dtype=torch.bfloat16) / D**0.5
        w2 = torch.randn(E, D, I, device=DEV, dtype=torch.bfloat16) / I**0.5
        best_gemv = None
        for T in ts:
            x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
            ids_sets = _routes(T, E, 8 if T <= 64 else 1)
            wts = torch.rand(T, K, device=DEV)
            touched = torch.unique(ids_sets[0]).numel()
            read_ms = touched * 3 * I * D * 2 / copy_gbs / 1e6
            ref = fused_moe_ref(x, w13, w2, ids_sets[0], wts).float()
            cell: dict[str, object] = {"E": E, "I": I, "T": T, "touched_read_ms": read_ms}
            if T == 1:  # gemv tiles: up and down graph-timed apart
                ups, downs = {}, {}
                for g in GEMV_TILES:
                    acts = [gemv_gate_up(x, w13, ids, g) for ids in ids_sets]
                    ups[g] = ms_graph([partial(gemv_gate_up, x, w13, ids, g) for ids in ids_sets])
                    downs[g] = ms_graph([partial(gemv_down_sum, a, w2, ids, wts, g)
                                         for a, ids in zip(acts, ids_sets, strict=True)])  # fmt: skip
                bu, bd = min(ups, key=ups.__getitem__), min(downs, key=downs.__getitem__)
                best_gemv = GemvTile(*bu[:3], *bd[3:6], bu.up_stages, bd.down_stages)
                cell["gemv_up_ms"] = {str(tuple(g)[:3] + (g.up_stages,)): v for g, v in ups.items()}
                cell["gemv_down_ms"] = {str(tuple(g)[3:6] + (g.down_stages,)): v for g, v in downs.items()}
                for part in ("up", "down"):
                    times_ = cell[f"gemv_{part}_ms"]
                    assert isinstance(times_, dict)
                    print(f"E={E} T=1 gemv {part} graph ms: " + ", ".join(f"{k}: {v:.4f}" for k, v in times_.items()))
            res = {}
            for cfg in _explore_cands(T, E, I, best_gemv):
                fns = [partial(fused_moe, x, w13, w2, ids, wts, config=cfg) for ids in ids_sets]
                try:
                    o = fns[0]().float()
                    err = ((o - ref).norm() / ref.norm()).item()
                    t_e = ms(rotating(fns))
                    t_g = ms_graph(fns) if T <= 1024 else float("nan")
                except Exception as e:  # out of shared memory etc.: recorded, not fatal
                    print(f"  E={E} T={T} {_cfg_str(cfg)} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                res[_cfg_str(cfg)] = {"eager_ms": t_e, "graph_ms": t_g, "rel_err": err,
                                      "x_read": min(t_e, t_g) / read_ms}  # fmt: skip
                print(f"E={E:>3} I={I:>4} T={T:>4} {_cfg_str(cfg):>70} eager {t_e:.4f} graph {t_g:.4f} "
                      f"x read {res[_cfg_str(cfg)]['x_read']:.2f} err {err:.1e}")  # fmt: skip
            cell["cands"] = res
            out.append(cell)
            RESULTS["moe_explore"] = out
            save()
        del w13, w2
        torch.cuda.empty_cache()


def bench_moe(copy_gbs: float, ts: Sequence[int], sweep_ts: Sequence[int], workers: int,
              shapes: Sequence[tuple[int, int]] = MOE_SHAPES) -> None:  # fmt: skip
    if workers > 0:
        prewarm(ts, sweep_ts, workers, shapes)
    rows_out = []
    print(f"{'E':>4} {'I':>5} {'T':>6} {'cfg':>44} {'ms':>8} {'graph':>7} {'TFLOP/s':>7} {'%dense':>6} "
          f"{'loop ms':>8} {'read ms':>7} {'x read':>6} {'align/ref graph ms':>18}")  # fmt: skip
    for E, I in shapes:
        w13 = torch.randn(E, 2 * I, D, device=DEV, dtype=torch.bfloat16) / D**0.5
        w2 = torch.randn(E, D, I, device=DEV, dtype=torch.bfloat16) / I**0.5
        for T in ts:
            x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
            sets = 8 if T <= 64 else 1  # small T: rotate routes so touched weights are not L2-resident
            ids_sets = _routes(T, E, sets)
            wts = torch.rand(T, K, device=DEV)
            flops = 2 * T * K * 3 * I * D
            default = moe_config(T * K, E, 2, I, tokens=T)
            cfgs = [default]
            sweep: dict[str, object] = {}
            base = _baseline_config(T, E, I)  # the previous defaults, timed in this run
            cfgs += [base] if base != default else []
            cfgs += _extras(default, I)
            if T in sweep_ts:  # best gate_up and best down tile per BLOCK_M (and act order), composed
                for bm in _sweep_bms(T, E):
                    for srt in SORTED_SWEEP.get(bm, (False,)):
                        downs = [t for t in DOWN_TILES[bm] if t.n_split == 0 or t.block_k >= I]
                        p = _parts(x, w13, w2, ids_sets, wts, bm, UP_TILES[bm], downs, E, srt)
                        key = f"{bm}{' sorted' * srt}"
                        sweep[key] = {k: {str(tuple(t)): v for t, v in d.items()} for k, d in p.items()}
                        if p["up"] and p["down"]:
                            best = MoeConfig(bm, min(p["up"], key=p["up"].__getitem__),
                                             min(p["down"], key=p["down"].__getitem__), sorted_act=srt)  # fmt: skip
                            cfgs += [best] if best not in cfgs else []
            times = {}
            for cfg in cfgs:
                fns = [partial(fused_moe, x, w13, w2, ids, wts, config=cfg) for ids in ids_sets]
                try:
                    times[cfg] = ms(rotating(fns))
                except Exception as e:
                    print(f"  cfg {_cfg_str(cfg)} failed: {type(e).__name__}: {str(e)[:120]}")
            sweep["pipeline_ms"] = {_cfg_str(c): v for c, v in times.items()}
            # a swept row reports the fastest pipeline, any other the default (the rest stay in sweep_ms)
            cfg = min(times, key=times.__getitem__) if T in sweep_ts or default not in times else default
            t = times[cfg]
            fns = [partial(fused_moe, x, w13, w2, ids, wts, config=cfg) for ids in ids_sets]
            tg = ms_graph(fns) if T <= 1024 else float("nan")
            # the align twins alone, graph-timed (no host sync in either), and their outputs compared
            al = [partial(moe_align, ids, E, cfg.block_m) for ids in ids_sets]
            al_ref = [partial(moe_align_ref, ids, E, cfg.block_m) for ids in ids_sets]
            a, r = al[0](), al_ref[0]()
            used = int(r.num_padded.item())
            align_same = torch.equal(a.sorted_ids[:used], r.sorted_ids[:used]) and torch.equal(
                a.block_expert, r.block_expert)  # fmt: skip
            t_al, t_al_ref = ms_graph(al), ms_graph(al_ref)
            if cfg.gemv is not None:  # the gemv path's two kernels, graph-timed (no align, no sum launch)
                g = cfg.gemv
                acts = [gemv_gate_up(x, w13, ids, g) for ids in ids_sets]
                parts = {"up": {cfg.gate_up: ms_graph([partial(gemv_gate_up, x, w13, ids, g) for ids in ids_sets])},
                         "down": {cfg.down: ms_graph([partial(gemv_down_sum, a, w2, ids, wts, g)
                                                      for a, ids in zip(acts, ids_sets, strict=True)])}}  # fmt: skip
            else:
                parts = _parts(x, w13, w2, ids_sets, wts, cfg.block_m, [cfg.gate_up], [cfg.down], E, cfg.sorted_act)
            fb = [partial(fused_moe, x, w13, w2, ids, wts, config=base) for ids in ids_sets]
            tb = times[base] if base in times else ms(rotating(fb))
            tbg = ms_graph(fb) if T <= 1024 else float("nan")
            y = torch.randn(T * K, D, device=DEV, dtype=torch.bfloat16)
            t_sum = ms(partial(moe_sum, y, ids_sets[0]))
            out = fns[0]()
            ref = fused_moe_ref(x, w13, w2, ids_sets[0], wts)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            same_ref_align = torch.equal(out, fused_moe(x, w13, w2, ids_sets[0], wts, config=cfg, align="ref"))
            tl_ = ms(rotating([partial(fused_moe_ref, x, w13, w2, ids, wts) for ids in ids_sets]), rep=200)
            # the weight-streaming floor, measured: every expert's w13 and w2 read once (amax: one read pass, no
            # write), against which the E = 256 goal (50% of dense) is judged; T >= 4k touches every expert
            t_wread = ms(partial(_read_once, w13, w2)) if T >= 4096 else float("nan")
            dense_w = torch.randn(D, 3 * K * I, device=DEV, dtype=torch.bfloat16)
            td = ms(partial(torch.matmul, x, dense_w))  # [T, D] @ [D, 3KI]: the same FLOPs as the MoE
            del dense_w, y
            touched = torch.unique(ids_sets[0]).numel()
            read_ms = touched * 3 * I * D * 2 / copy_gbs / 1e6
            best_t = min(t, tg) if not math.isnan(tg) else t
            row = {"E": E, "I": I, "T": T, "cfg": [cfg.block_m, list(cfg.gate_up), list(cfg.down)],
                   "gemv": list(cfg.gemv) if cfg.gemv is not None else None,
                   "default_cfg": [default.block_m, list(default.gate_up), list(default.down)],
                   "default_cfg_ms": times.get(default, float("nan")), "ms": t, "graph_ms": tg,
                   "TFLOPs": flops / t / 1e9, "dense_ms": td, "dense_TFLOPs": flops / td / 1e9,
                   "pct_dense": 100 * td / t, "loop_ms": tl_, "speedup_vs_loop": tl_ / t,
                   "touched_experts": touched, "touched_read_ms": read_ms, "x_read": best_t / read_ms,
                   "rel_err_vs_loop": err, "bitwise_same_with_ref_align": same_ref_align,
                   "align_graph_ms": t_al, "align_ref_graph_ms": t_al_ref, "align_equal_ref": align_same,
                   "gate_up_ms": next(iter(parts["up"].values()), float("nan")),
                   "down_ms": next(iter(parts["down"].values()), float("nan")), "sum_ms": t_sum,
                   "sweep_ms": sweep, "baseline_cfg": _cfg_str(base), "baseline_ms": tb, "baseline_graph_ms": tbg,
                   "sorted_act": cfg.sorted_act, "weights_read_ms": t_wread,
                   "weights_read_GBps": (w13.numel() + w2.numel()) * 2 / t_wread / 1e6,
                   "x_read_baseline": (min(tb, tbg) if not math.isnan(tbg) else tb) / read_ms}  # fmt: skip
            rows_out.append(row)
            print(f"{E:>4} {I:>5} {T:>6} {_cfg_str(cfg):>44} {t:>8.3f} {tg:>7.3f} {row['TFLOPs']:>7.0f} "
                  f"{row['pct_dense']:>5.0f}% {tl_:>8.2f} {read_ms:>7.3f} {row['x_read']:>5.2f}x "
                  f"{t_al:>8.4f}/{t_al_ref:.4f}  up {row['gate_up_ms']:.3f} down {row['down_ms']:.3f} "
                  f"sum {t_sum:.3f} err {err:.1e} same {same_ref_align and align_same} | baseline {tb:.3f} / "
                  f"graph {tbg:.3f} ({row['x_read_baseline']:.2f}x read) | weights read {t_wread:.3f} ms")  # fmt: skip
            RESULTS["moe"] = rows_out
            save()
        del w13, w2
        torch.cuda.empty_cache()


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
    lines += ["", "| E | I | T | BM: gate_up / down (bn,bk,g,w,s) | eager ms | graph ms | TFLOP/s | % dense | "
              "loop ms | vs loop | touched-read ms | x read |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
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
    lines += ["", "| E | I | T | align graph ms | torch align graph ms | gate_up ms | down ms | sum ms | dense ms | "
              "same as ref align |", "|---|---|---|---|---|---|---|---|---|---|"]
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
