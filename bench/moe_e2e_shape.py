"""The fused MoE at the end-to-end model's shape (issue 6's 2.5B V3-shaped model: D = 2048, E = 64, I = 512, K = 6,
bf16) at decode batches T = 16..256: each part alone, a tile sweep per GEMM, the align's launch shapes, and named
default / candidate configs timed side by side; D = 7168 cells beside them.

The engine runs its S = 2 shared experts fused into the routed MoE (engine/layers/moe.py): w13 / w2 hold E + S = 66
rows and every token has K + S = 8 pairs, the last S on experts 64, 65 with weight 1.0 (each of those gets all T
tokens). Shape "real" is that: the kernels see E = 66, K = 8; shape "k6" is the routed part alone (E = 64, K = 6).

Run (GPU): python bench/moe_e2e_shape.py --phase sweep                -> $OUT/moe_e2e_sweep.json
           python bench/moe_e2e_shape.py --phase compare[+extras] --configs s5,default --shapes real,k6
                                                                      -> $OUT/moe_e2e_compare.json
           (session 5 run 2: --configs pre_s5,nopdl,s5 --shapes k6; session 6 run 1: --configs
            s5,candidate,cand_align,cand_tiles,other_bm --shapes real,k6)

Timer: one CUDA graph holding CALLS calls in turn, call i on route set i % CALLS and weight set i % WSETS, replayed
back to back (events around n replays, median of reps) / CALLS. As in the engine's graph: no flush between calls,
each call's weights come from HBM (a weight set is 403 MB at D = 2048, 415 MB with the 2 shared rows, 2.8 GB at
D = 7168, the L2 60 MB; the down alone streams 134 MB a set), the kernel boundaries and tails are counted, the
graph launch is amortized over CALLS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from moe_bench import _cfg_str, _prewarm_pool  # bench/: python bench/<script>.py puts it on the path
from timing import ceilings

from r3trace.kernels.moe.align import MoeAlignment, moe_align, moe_align_ref
from r3trace.kernels.moe.config import SHORT_D_DOWN, SHORT_D_DOWN_BM32, SHORT_D_UP_BM16, SHORT_D_UP_BM32
from r3trace.kernels.moe.fused_moe import AlignTile, GemmTile, MoeConfig, fused_moe, fused_moe_ref, moe_config, moe_sum
from r3trace.kernels.moe.gemm import moe_down, moe_gate_up

OUT = Path(os.environ.get("OUT", "out"))
E2E = (2048, 64, 512, 6)  # (D, E, I, K) of the end-to-end model's routed experts
# (D, E, I, K, S) as the kernels see them: E and K count the S shared experts' rows and pairs
SHAPES = {"k6": (*E2E, 0), "real": (2048, 66, 512, 8, 2)}
TS = (16, 32, 64, 128, 256)
CELLS_7168 = [(7168, 256, 256, 8, T) for T in (16, 64, 256)] + [(7168, 32, 2048, 8, T) for T in (16, 64, 256)]
CALLS = 8
# GemmTile(bn, bk, group_m, warps, stages[, interleave][, n_split][, tma]). gate_up: N = I = 512, K = D = 2048;
# shared memory per stage (BM + 2 BN) BK 2 B: the committed (32, 256, 3 stages) holds 120 KB at BM 16 (one program
# per SM); the smaller ones let 2-3 programs share an SM so one's pipeline fill overlaps another's stream
UP = [GemmTile(32, 256, 1, 4, 3), GemmTile(32, 128, 1, 4, 4), GemmTile(32, 128, 1, 4, 3), GemmTile(64, 128, 1, 4, 3),
      GemmTile(64, 64, 1, 4, 4), GemmTile(32, 64, 1, 4, 6), GemmTile(16, 256, 1, 4, 3), GemmTile(64, 128, 1, 8, 3),
      GemmTile(32, 256, 1, 4, 3, True), GemmTile(64, 128, 1, 4, 3, True), GemmTile(128, 64, 1, 8, 4, True),
      GemmTile(32, 128, 1, 4, 4, tma=True), GemmTile(64, 128, 1, 4, 3, tma=True), GemmTile(32, 256, 1, 4, 3, tma=True),
      GemmTile(64, 128, 1, 4, 3, True, tma=True), GemmTile(32, 128, 1, 2, 4), GemmTile(64, 128, 4, 4, 4)]  # fmt: skip
# down: N = D = 2048, K = I = 512 (4 steps at BK 128); n_split: the whole K in one tile, programs walk N
DOWN = [GemmTile(64, 128, 1, 4, 4), GemmTile(64, 256, 1, 4, 3), GemmTile(128, 128, 1, 4, 3), GemmTile(32, 256, 1, 4, 3),
        GemmTile(64, 64, 1, 4, 6), GemmTile(128, 64, 1, 4, 4), GemmTile(256, 64, 1, 8, 3), GemmTile(64, 128, 1, 2, 4),
        GemmTile(64, 128, 1, 4, 4, tma=True), GemmTile(128, 128, 1, 4, 3, tma=True),
        GemmTile(64, 256, 1, 4, 3, tma=True),
        GemmTile(32, 512, 1, 4, 3, n_split=16), GemmTile(32, 512, 1, 4, 2, n_split=32),
        GemmTile(16, 512, 1, 4, 3, n_split=32), GemmTile(64, 512, 1, 4, 2, n_split=8),
        GemmTile(32, 512, 1, 4, 3, n_split=16, tma=True), GemmTile(64, 128, 4, 4, 4)]  # fmt: skip


def align_tiles(M: int, E: int) -> list[AlignTile]:
    """AlignTile(one_tile_pairs, sub, chunk, warps): the old launch, one [M, E] tile (when <= 64k int32), single
    programs on narrower tiles with fewer warps, and several chunk programs (two launches)."""
    out = [AlignTile()]
    if triton_pow2(M) * triton_pow2(E) <= 65536:
        out += [AlignTile(M, 0, 0, w) for w in (4, 8, 16)]
    out += [AlignTile(0, s, 0, w) for s, w in ((32, 2), (32, 4), (64, 4), (128, 4))]
    out += [AlignTile(0, s, c, w) for s, c, w in ((64, 64, 4), (128, 128, 4), (128, 128, 8), (64, 256, 4))]
    return out


def triton_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def graph_ms(fns: Sequence[Callable[[], object]], n: int = 20, reps: int = 7) -> float:
    """ms per call: one graph with every fn in turn, replayed back to back n times, median over reps."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in fns:
            f()  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / n / len(fns))
    return statistics.median(times)


def safe(fn: Callable[[], float], what: str) -> float:
    try:
        return fn()
    except Exception as e:  # out of shared memory etc.: reported, the sweep goes on
        print(f"  {what} failed: {type(e).__name__}: {str(e)[:150]}")
        return float("nan")


class Case:
    """CALLS route sets (x, ids, weights) and WSETS weight sets at one (D, E, I, K, T); the last `shared` of the E
    experts are the fused shared ones (engine/layers/moe.py): every token's last `shared` of its K pairs, weight 1."""

    def __init__(self, D: int, E: int, I: int, K: int, T: int, wsets: int, shared: int = 0) -> None:
        bf, dev, S = torch.bfloat16, "cuda", shared
        self.D, self.E, self.I, self.K, self.T = D, E, I, K, T
        self.w13 = [torch.randn(E, 2 * I, D, device=dev, dtype=bf) / D**0.5 for _ in range(wsets)]
        self.w2 = [torch.randn(E, D, I, device=dev, dtype=bf) / I**0.5 for _ in range(wsets)]
        self.x = [torch.randn(T, D, device=dev, dtype=bf) for _ in range(CALLS)]
        shared_ids = torch.arange(E - S, E, device=dev, dtype=torch.int32).expand(T, S)  # [T, S]
        routed = [torch.rand(T, E - S, device=dev).topk(K - S, dim=-1).indices.to(torch.int32) for _ in range(CALLS)]
        self.ids = [torch.cat([r, shared_ids], dim=1) for r in routed]  # [T, K]: K - S distinct routed, then S
        self.wts = [torch.cat([torch.rand(T, K - S, device=dev), torch.ones(T, S, device=dev)], 1) for _ in routed]

    def w(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13[i % len(self.w13)], self.w2[i % len(self.w2)]

    def pipeline_ms(self, cfg: MoeConfig) -> float:
        return graph_ms([partial(fused_moe, self.x[i], *self.w(i), self.ids[i], self.wts[i], config=cfg)
                         for i in range(CALLS)])  # fmt: skip

    def parts_ms(self, cfg: MoeConfig, ups: Sequence[GemmTile], downs: Sequence[GemmTile]) -> dict[str, object]:
        """align, each gate_up tile, each down tile (on the gate_up's act) and the sum, each graph-timed alone."""
        bm, K, M = cfg.block_m, self.K, self.T * self.K
        al = [moe_align(ids, self.E, bm, tile=cfg.align) for ids in self.ids]
        act = [moe_gate_up(self.x[i], self.w(i)[0], al[i], K, bm, cfg.gate_up) for i in range(CALLS)]
        ys = [torch.randn(M, self.D, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        r: dict[str, object] = {
            "align": graph_ms([partial(moe_align, ids, self.E, bm, tile=cfg.align) for ids in self.ids]),
            "sum": graph_ms([partial(moe_sum, ys[i], self.ids[i]) for i in range(CALLS)]),
        }
        up: dict[str, float] = {}
        for t in ups:
            fns = [partial(moe_gate_up, self.x[i], self.w(i)[0], al[i], K, bm, t) for i in range(CALLS)]
            up[str(tuple(t))] = safe(partial(graph_ms, fns), f"bm {bm} up {tuple(t)}")
        down: dict[str, float] = {}
        for t in downs:
            fns = [partial(moe_down, act[i], self.w(i)[1], al[i], self.wts[i], bm, t) for i in range(CALLS)]
            down[str(tuple(t))] = safe(partial(graph_ms, fns), f"bm {bm} down {tuple(t)}")
        r["up"], r["down"] = up, down
        return r

    def check(self, cfg: MoeConfig) -> dict[str, object]:
        """rel. error vs fused_moe_ref, bitwise equality with the torch align twin, the alignments equal."""
        w13, w2 = self.w(0)
        out = fused_moe(self.x[0], w13, w2, self.ids[0], self.wts[0], config=cfg)
        ref = fused_moe_ref(self.x[0], w13, w2, self.ids[0], self.wts[0])
        same = torch.equal(out, fused_moe(self.x[0], w13, w2, self.ids[0], self.wts[0], config=cfg, align="ref"))
        return {"rel_err": ((out.float() - ref.float()).norm() / ref.float().norm()).item(), "same_ref_align": same}

    def touched_read_ms(self, copy_gbs: float) -> float:
        touched = statistics.mean(torch.unique(ids).numel() for ids in self.ids)
        return touched * 3 * self.I * self.D * 2 / copy_gbs / 1e6


def previous_default(D: int, E: int, I: int, K: int, T: int) -> MoeConfig:
    """moe_config as committed before session 5 (80a576d): hidden unknown (the D = 7168 tiles), the old align."""
    return moe_config(T * K, E, 2, I, tokens=T)._replace(align=None, pdl=False)


def new_default(D: int, E: int, I: int, K: int, T: int) -> MoeConfig:
    """What fused_moe runs at this shape (moe_config as committed now)."""
    return moe_config(T * K, E, 2, I, tokens=T, hidden=D)


def s5_default(D: int, E: int, I: int, K: int, T: int) -> MoeConfig:
    """moe_config as committed after session 5 (b7869c4): 64-pair align chunks, the 3-stage short-D tiles."""
    c = new_default(D, E, I, K, T)
    if c.align is not None:
        c = c._replace(align=c.align._replace(sub=64, chunk=64))
    if c.down in (SHORT_D_DOWN, SHORT_D_DOWN_BM32):  # the short-D tiers (BLOCK_M 16 / 32 as now)
        c = c._replace(gate_up=SHORT_D_UP_BM16 if c.block_m == 16 else SHORT_D_UP_BM32, down=SHORT_D_DOWN)
    return c


# session 5 run 2's part winners, each alone (not yet in the pipeline then): gate_up at BLOCK_M 16 and the down at
# BLOCK_M 32 with 2 stages, TMA weights (session 6's defaults: SHORT_D_UP_FEW below 7 rows, SHORT_D_DOWN_BM32)
UP16_S2 = GemmTile(32, 256, 1, 4, 2, tma=True)
DOWN_S2 = GemmTile(128, 128, 1, 4, 2, tma=True)


def _align32(c: MoeConfig) -> MoeConfig:
    """32-pair chunks on [32, E] one-hot tiles (alone: E = 64 T = 64 6.1 vs 8.3 us, E = 256 T = 16 8.8 vs 14.3)."""
    return c._replace(align=c.align._replace(sub=32, chunk=32)) if c.align is not None else c


def _tiles_s2(c: MoeConfig) -> MoeConfig:
    """The short-D tiers with run 2's GEMM winners: gate_up UP16_S2 at BLOCK_M 16, down DOWN_S2 at BLOCK_M 32."""
    if c.down != SHORT_D_DOWN:
        return c
    return c._replace(gate_up=UP16_S2) if c.block_m == 16 else c._replace(down=DOWN_S2)


def candidate(D: int, E: int, I: int, K: int, T: int) -> MoeConfig:
    """Session 5 run 2's part winners composed into the session 5 default: the 32-pair align, the 2-stage tiles."""
    return _tiles_s2(_align32(s5_default(D, E, I, K, T)))


def other_bm(D: int, E: int, I: int, K: int, T: int) -> MoeConfig:
    """The candidate at the other short-D tier (BLOCK_M 16 <-> 32): does the 8-rows edge hold when 2 of the 66 experts
    get all T rows (real shape, T = 64: 7.8 rows per expert on average, 6 on the routed ones, 64 on the shared)?"""
    c = s5_default(D, E, I, K, T)
    if c.down != SHORT_D_DOWN:
        return c
    bm, up = (32, SHORT_D_UP_BM32) if c.block_m == 16 else (16, SHORT_D_UP_BM16)
    return _tiles_s2(_align32(c._replace(block_m=bm, gate_up=up)))


CONFIGS: dict[str, Callable[[int, int, int, int, int], MoeConfig]] = {
    "pre_s5": previous_default,
    "nopdl": lambda *shape: s5_default(*shape)._replace(pdl=False),  # session 5 run 2's "new"
    "s5": s5_default,
    "default": new_default,
    "candidate": candidate,
    "cand_align": lambda *shape: _align32(s5_default(*shape)),
    "cand_tiles": lambda *shape: _tiles_s2(s5_default(*shape)),
    "other_bm": other_bm,
}

# run 2 extras, around run 1's winners: align launches, down and gate_up tiles (TMA, stages, warps)
ALIGN2 = [AlignTile(0, 32, 32, 4), AlignTile(0, 32, 32, 2), AlignTile(0, 64, 64, 2), AlignTile(0, 64, 64, 8),
          AlignTile(0, 32, 64, 4), AlignTile(0, 64, 128, 4), AlignTile(0, 16, 32, 2)]  # fmt: skip
DOWN2 = [SHORT_D_DOWN, GemmTile(128, 128, 1, 4, 4, tma=True), GemmTile(128, 128, 1, 8, 3, tma=True),
         GemmTile(256, 128, 1, 8, 2, tma=True), GemmTile(128, 256, 1, 4, 2, tma=True),
         GemmTile(256, 64, 1, 8, 4, tma=True), GemmTile(128, 64, 1, 4, 4, tma=True),
         GemmTile(128, 64, 1, 4, 6, tma=True), GemmTile(256, 64, 1, 8, 3, tma=True),
         GemmTile(128, 128, 1, 4, 2, tma=True)]  # fmt: skip
UP2 = {16: [GemmTile(32, 256, 1, 4, 3), GemmTile(32, 256, 1, 4, 4, tma=True), GemmTile(32, 256, 1, 4, 2, tma=True),
            GemmTile(32, 512, 1, 4, 2, tma=True), GemmTile(64, 256, 1, 8, 2, True, tma=True)],
       32: [SHORT_D_UP_BM32, GemmTile(64, 128, 1, 4, 4, True, tma=True), GemmTile(64, 256, 1, 8, 2, True, tma=True),
            GemmTile(32, 256, 1, 4, 3, True, tma=True), GemmTile(64, 128, 1, 8, 3, True, tma=True)]}  # fmt: skip


def _prewarm_job(job: tuple) -> str:
    """Compile one GEMM tile, align launch or whole pipeline at the sizes the run uses (E = 8 experts for the GEMMs
    alone: E does not enter their cache key, every size is a multiple of 16 or the same as at E = 64; a pipeline
    on uninitialized weights at the real E: values do not enter a compile)."""
    kind, D, E, I, K, T, bm, tile, *pdl = job
    ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices.to(torch.int32)
    if kind == "align":
        moe_align(ids, E, bm, tile=tile, pdl=bool(pdl and pdl[0]))
    elif kind == "pipe":
        w13 = torch.empty(E, 2 * I, D, device="cuda", dtype=torch.bfloat16)
        w2 = torch.empty(E, D, I, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        fused_moe(x, w13, w2, ids, torch.rand(T, K, device="cuda"), config=tile)
    else:
        ids = torch.rand(T, 8, device="cuda").topk(K, dim=-1).indices.to(torch.int32)
        al = moe_align(ids, 8, bm)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        if kind == "up":
            moe_gate_up(x, torch.randn(8, 2 * I, D, device="cuda", dtype=torch.bfloat16), al, K, bm, tile)
        else:
            act = torch.randn(T * K, I, device="cuda", dtype=torch.bfloat16)
            w2 = torch.randn(8, D, I, device="cuda", dtype=torch.bfloat16)
            moe_down(act, w2, al, torch.rand(T, K, device="cuda"), bm, tile)
    torch.cuda.synchronize()
    return str(job)


def sweep_bms(T: int) -> tuple[int, ...]:
    return (16, 32)


def sweep(copy_gbs: float, ts: Sequence[int], workers: int, res: dict[str, object]) -> None:
    D, E, I, K = E2E
    jobs = {("align", D, e, I, k, T, moe_config(T * k, e, 2, i, tokens=T).block_m, a)
            for T in ts for e, i, k in ((E, I, K), (256, 256, 8), (32, 2048, 8)) for a in align_tiles(T * k, e)}
    # GEMMs: one T (every M = T K and every padded P is a multiple of 16: the same specialization at each T)
    jobs |= {(p, D, E, I, K, 64, bm, t) for T in ts for bm in sweep_bms(T) for p, ts_ in (("up", UP), ("down", DOWN))
             for t in ts_}  # fmt: skip
    if workers:
        _prewarm_pool(_prewarm_job, sorted(jobs, key=str), workers)
    rows: list[dict[str, object]] = []
    res["sweep"] = rows
    for T in ts:
        for e, i, k in ((E, I, K), (256, 256, 8), (32, 2048, 8)):  # the align alone: ids only
            ids = [torch.rand(T, e, device="cuda").topk(k, dim=-1).indices.to(torch.int32) for _ in range(CALLS)]
            bm = moe_config(T * k, e, 2, i, tokens=T).block_m
            al: dict[str, float] = {}
            r = moe_align_ref(ids[0], e, bm)
            for a in align_tiles(T * k, e):
                al[str(tuple(a))] = safe(partial(graph_ms, [partial(moe_align, x, e, bm, tile=a) for x in ids]), str(a))
                ok = al[str(tuple(a))] == al[str(tuple(a))]  # timed (not NaN): then check it, compiled
                if ok and not _align_same(moe_align(ids[0], e, bm, tile=a), r):
                    print(f"  MISMATCH align {a} E={e} T={T}")
                    al[str(tuple(a))] = float("nan")
            ref = graph_ms([partial(moe_align_ref, x, e, bm) for x in ids])
            rows.append({"E": e, "I": i, "K": k, "T": T, "block_m": bm, "align_ms": al, "align_ref_ms": ref})
            print(f"align E={e} K={k} T={T} bm={bm}: ref {ref * 1e3:.1f} us; " +
                  ", ".join(f"{a} {v * 1e3:.1f}" for a, v in al.items()))  # fmt: skip
        cs = Case(D, E, I, K, T, wsets=4)
        base = previous_default(D, E, I, K, T)
        row: dict[str, object] = {"D": D, "E": E, "I": I, "K": K, "T": T, "default": _cfg_str(base),
                                  "touched_read_ms": cs.touched_read_ms(copy_gbs), "default_ms": cs.pipeline_ms(base)}
        best: list[MoeConfig] = []
        for bm in sweep_bms(T):
            p = cs.parts_ms(MoeConfig(bm, UP[0], DOWN[0]), UP, DOWN)
            row[f"parts_bm{bm}"] = p
            up = min(UP, key=lambda t: _nan_inf(p["up"][str(tuple(t))]))  # type: ignore[index]
            down = min(DOWN, key=lambda t: _nan_inf(p["down"][str(tuple(t))]))  # type: ignore[index]
            best.append(MoeConfig(bm, up, down))
            print(f"T={T} bm={bm}: align {p['align']*1e3:.1f} us sum {p['sum']*1e3:.1f} us; up " +
                  ", ".join(f"{t} {v*1e3:.1f}" for t, v in p["up"].items()) + "; down " +  # type: ignore[union-attr]
                  ", ".join(f"{t} {v*1e3:.1f}" for t, v in p["down"].items()))  # type: ignore[union-attr]  # fmt: skip
        row["best_ms"] = {_cfg_str(c): safe(partial(cs.pipeline_ms, c), _cfg_str(c)) for c in best}
        row["base_parts"] = cs.parts_ms(base, [base.gate_up], [base.down])
        print(f"T={T}: default {_cfg_str(base)} {row['default_ms']:.4f} ms, touched-read {row['touched_read_ms']:.4f};"
              f" best composed {row['best_ms']}")  # fmt: skip
        rows.append(row)
        del cs
        torch.cuda.empty_cache()
        save(res, "moe_e2e_sweep.json")


def _align_same(a: MoeAlignment, r: MoeAlignment) -> bool:
    used = int(r.num_padded.item())
    return (int(a.num_padded.item()) == used and torch.equal(a.sorted_ids[:used], r.sorted_ids[:used])
            and torch.equal(a.block_expert, r.block_expert))  # fmt: skip


def _nan_inf(v: object) -> float:
    f = float(v)  # type: ignore[arg-type]
    return float("inf") if f != f else f


def compare_cells(shapes: Sequence[str], ts: Sequence[int], cells_7168: Sequence[tuple]) -> list[tuple[int, ...]]:
    """(D, E, I, K, T, S) per cell: each named shape at every T, then the D = 7168 cells (no shared experts)."""
    return [(*SHAPES[s][:4], T, SHAPES[s][4]) for s in shapes for T in ts] + [(*c, 0) for c in cells_7168]


def prewarm_compare(cells: Sequence[tuple], names: Sequence[str], ts: Sequence[int], workers: int,
                    with_extras: bool) -> None:  # fmt: skip
    """Every kernel compare (and extras) will run, compiled in parallel processes first."""
    jobs = {("pipe", D, E, I, K, T, 0, CONFIGS[n](D, E, I, K, T)) for D, E, I, K, T, _ in cells for n in names}
    D, E, I, K = E2E
    for T in ts if with_extras else []:
        for e, i, k in ((E, I, K), (256, 256, 8), (32, 2048, 8)):
            new = moe_config(T * k, e, 2, i, tokens=T, hidden=D if e == E else 7168)
            al = [(AlignTile(), False), (new.align, False), (new.align, True)] + [(a, False) for a in ALIGN2]
            jobs |= {("align", D, e, i, k, T, new.block_m, a, pdl) for a, pdl in al}
        bm = new_default(D, E, I, K, T).block_m
        jobs |= {("up", D, E, I, K, 64, bm, t) for t in UP2[bm]} | {("down", D, E, I, K, 64, bm, t) for t in DOWN2}
    if workers:
        _prewarm_pool(_prewarm_job, sorted(jobs, key=str), workers)


def compare(
    copy_gbs: float, cells: Sequence[tuple], names: Sequence[str], parts_ts: Sequence[int], res: dict[str, object]
) -> None:
    """The named configs (CONFIGS) at each cell; names giving the same MoeConfig are timed once. Each distinct config
    twice, in turn (ABCABC): drift shows as one config's two figures apart. Ratios are to the first name's min."""
    rows: list[dict[str, object]] = []
    res["compare"] = rows
    for D, E, I, K, T, S in cells:
        cs = Case(D, E, I, K, T, wsets=4 if D == 2048 else 2, shared=S)
        cfgs = {n: CONFIGS[n](D, E, I, K, T) for n in names}
        distinct = list(dict.fromkeys(cfgs.values()))
        times: dict[MoeConfig, list[float]] = {c: [] for c in distinct}
        for _ in range(2):
            for c in distinct:
                times[c].append(safe(partial(cs.pipeline_ms, c), _cfg_str(c)))
        checks = {c: cs.check(c) for c in distinct}
        read = cs.touched_read_ms(copy_gbs)
        row: dict[str, object] = {"D": D, "E": E, "I": I, "K": K, "T": T, "S": S, "touched_read_ms": read, "configs": {
            n: {"cfg": f"{_cfg_str(c)} align={c.align} pdl={c.pdl}", "ms": times[c], "check": checks[c]}
            for n, c in cfgs.items()}}  # fmt: skip
        if D == 2048 and T in parts_ts:  # align / gate_up / down / sum, each alone
            row["parts"] = {n: cs.parts_ms(c, [c.gate_up], [c.down]) for n, c in cfgs.items() if c in distinct}
        rows.append(row)
        base = min(times[cfgs[names[0]]])
        print(f"D={D} E={E} I={I} K={K} S={S} T={T}: read {read * 1e3:.1f} us; " + ", ".join(
            f"{n} {min(times[c]) * 1e3:.1f} ({'/'.join(f'{v * 1e3:.1f}' for v in times[c])}; "
            f"{min(times[c]) / base:.3f})" for n, c in cfgs.items()))  # fmt: skip
        for c in distinct:
            print(f"   {_cfg_str(c)} align={c.align} pdl={c.pdl}: {checks[c]}")
        for n, p in row.get("parts", {}).items():  # type: ignore[attr-defined]
            print(f"   parts {n}: align {p['align']*1e3:.1f} us, up {list(p['up'].values())[0]*1e3:.1f}, down "
                  f"{list(p['down'].values())[0]*1e3:.1f}, sum {p['sum']*1e3:.1f}")  # fmt: skip
        del cs
        torch.cuda.empty_cache()
        save(res, "moe_e2e_compare.json")


def extras(ts: Sequence[int], res: dict[str, object]) -> None:
    """Run 2's extra launches around run 1's winners (module lists ALIGN2, DOWN2, UP2), each part alone."""
    D, E, I, K = E2E
    rows: list[dict[str, object]] = []
    res["extras"] = rows
    for T in ts:
        for e, i, k in ((E, I, K), (256, 256, 8), (32, 2048, 8)):
            ids = [torch.rand(T, e, device="cuda").topk(k, dim=-1).indices.to(torch.int32) for _ in range(CALLS)]
            new = moe_config(T * k, e, 2, i, tokens=T, hidden=D if e == E else 7168)
            r = moe_align_ref(ids[0], e, new.block_m)
            al: dict[str, float] = {}
            for a, pdl in [(AlignTile(), False), (new.align, False), (new.align, True)] + [(a, False) for a in ALIGN2]:
                key = f"{tuple(a) if a else None}{' pdl' * pdl}"
                fns = [partial(moe_align, x, e, new.block_m, tile=a, pdl=pdl) for x in ids]
                al[key] = safe(partial(graph_ms, fns), key)
                if al[key] == al[key] and not _align_same(moe_align(ids[0], e, new.block_m, tile=a, pdl=pdl), r):
                    print(f"  MISMATCH align {key} E={e} T={T}")
                    al[key] = float("nan")
            rows.append({"E": e, "K": k, "T": T, "block_m": new.block_m, "align_ms": al})
            print(f"align E={e} T={T}: " + ", ".join(f"{a} {v * 1e3:.1f}" for a, v in al.items()))
        cs = Case(D, E, I, K, T, wsets=4)
        new = new_default(D, E, I, K, T)
        p = cs.parts_ms(new, UP2[new.block_m], DOWN2)
        rows.append({"D": D, "E": E, "I": I, "K": K, "T": T, "block_m": new.block_m, "parts": p})
        print(f"T={T} bm={new.block_m}: up " + ", ".join(f"{t} {v * 1e3:.1f}" for t, v in p["up"].items())  # type: ignore[union-attr]
              + "; down " + ", ".join(f"{t} {v * 1e3:.1f}" for t, v in p["down"].items()))  # type: ignore[union-attr]  # fmt: skip
        del cs
        torch.cuda.empty_cache()
        save(res, "moe_e2e_compare.json")


def save(res: dict[str, object], name: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(res, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=("sweep", "compare", "compare+extras"), default="compare")
    ap.add_argument("--ts", default=",".join(map(str, TS)))
    ap.add_argument("--workers", type=int, default=12, help="prewarm processes; 0: compile inline")
    ap.add_argument("--d7168", default="all", help="ExIxT list of D = 7168 cells (K = 8), 'all' (CELLS_7168), 'none'")
    ap.add_argument("--copy-gbs", type=float, default=0.0, help="copy rate of an earlier run (skips the ceilings)")
    ap.add_argument("--configs", default="s5,default", help=f"compare: names from {','.join(CONFIGS)}")
    ap.add_argument("--shapes", default="real,k6", help=f"compare: D = 2048 shapes from {','.join(SHAPES)}")
    ap.add_argument("--parts-ts", default="64", help="compare: T at which each config's parts are timed alone")
    a = ap.parse_args()
    ts = [int(t) for t in a.ts.split(",")]
    given = [(7168, *(int(v) for v in c.split("x")[:2]), 8, int(c.split("x")[2])) for c in a.d7168.split(",")
             if c not in ("all", "none")]  # fmt: skip
    cells = CELLS_7168 if a.d7168 == "all" else given
    names = a.configs.split(",")
    copy_gbs, gemm = (a.copy_gbs, float("nan")) if a.copy_gbs else ceilings()
    res: dict[str, object] = {"ceilings": {"copy_GBps": copy_gbs, "gemm_TFLOPs": gemm, "measured": not a.copy_gbs}}
    if a.phase == "sweep":
        sweep(copy_gbs, ts, a.workers, res)
    else:
        all_cells = compare_cells(a.shapes.split(",") if a.shapes else [], ts, cells)
        prewarm_compare(all_cells, names, ts, a.workers, a.phase == "compare+extras")
        compare(copy_gbs, all_cells, names, [int(t) for t in a.parts_ts.split(",") if t], res)
        if a.phase == "compare+extras":
            extras(ts, res)


if __name__ == "__main__":
    main()
