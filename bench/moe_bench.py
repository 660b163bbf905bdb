"""Fused MoE section of bench/kernels.py (`--only moe`): the committed defaults, a per-GEMM tile sweep at
chosen T, the parts timed apart, the dense GEMM of equal FLOPs, the per-expert loop and the touched-weight read,
each in the same run. Numbers and their meaning: BENCHMARKS.md, "### Fused MoE"."""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import torch
from timing import RESULTS, ms, ms_graph, rotating, save

from r3trace.kernels.moe.align import moe_align, moe_align_ref
from r3trace.kernels.moe.fused_moe import (
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
from r3trace.kernels.moe.gemv import gemv_down_sum, gemv_gate_up

# ---------------------------------------------------------------- fused MoE
D, K = 7168, 8
DEV = "cuda"  # the device of every tensor the MoE sections make
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
# act at the sorted positions (the removed MoeConfig.sorted_act) is no longer swept: one value, act by pair index
SORTED_SWEEP: dict[int, tuple[bool, ...]] = {}


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
        moe_gate_up(x, w13, align, K, bm, tile)
    else:
        act = torch.randn(T * K, I, device=dev, dtype=torch.bfloat16)
        w2 = torch.randn(E, D, I, device=dev, dtype=torch.bfloat16)
        moe_down(act, w2, align, torch.rand(T, K, device=dev), bm, tile)
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
            todo = [(c.block_m, t, p, False) for c in (cfg, base, *_extras(cfg, I))
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
    act = moe_gate_up(x, w13, aligns[0], K, bm, up_tiles[0])
    out: dict[str, dict[GemmTile, float]] = {"up": {}, "down": {}}
    for part, tiles in (("up", up_tiles), ("down", down_tiles)):
        for tile in tiles:
            if part == "up":
                fns = [partial(moe_gate_up, x, w13, a, K, bm, tile) for a in aligns]
            else:
                fns = [partial(moe_down, act, w2, a, wts, bm, tile) for a in aligns]
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
    out = [default._replace(gate_up=default.gate_up._replace(num_stages=4))]
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
    return f"{c.block_m}: {tuple(c.gate_up)} / {tuple(c.down)}"


def _baseline_config(T: int, E: int, I: int) -> MoeConfig:
    """The baseline timed in the same run as every row: at BLOCK_M 128 (T >= 4k at both shapes) the tiles
    committed before session 4 (cdd240e); below it the defaults before session 3's gemv work (5267bf3): gemv
    (4 rows x 1024, 4 warps; down 4 rows x 256, 4 warps; runtime loops) at T = 1 where I <= 256, else grouped."""
    grouped = grouped_config(T * K, E, 2, I)
    if grouped.block_m == 128:  # session 4 baseline: the BLOCK_M 128 tier as committed before it (cdd240e)
        down = GemmTile(64, 256, 8, 8, 3, n_split=4) if I <= 256 else GemmTile(256, 64, 8, 8, 3)
        return MoeConfig(128, GemmTile(128, 64, 8, 8, 3, True), down)
    return grouped._replace(gemv=GemvTile(4, 1024, 4, 4, 256, 4)) if T == 1 and I <= 256 else grouped


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
                                             min(p["down"], key=p["down"].__getitem__))  # fmt: skip
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
                parts = _parts(x, w13, w2, ids_sets, wts, cfg.block_m, [cfg.gate_up], [cfg.down], E)
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
                   "weights_read_ms": t_wread,
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
