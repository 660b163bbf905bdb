"""Fused MoE exploration (bench/kernels.py `--only moe_explore`): candidate paths and tiles graph-timed per
(E, I, T), each checked against the reference first; gemv up and down kernels timed apart at T = 1."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from moe_bench import DEV, MOE_SHAPES, D, K, _baseline_config, _cfg_str, _prewarm_pipe, _prewarm_pool, _routes
from timing import RESULTS, ms, ms_graph, rotating, save

from r3trace.kernels.moe.fused_moe import (
    GemmTile,
    GemvTile,
    MoeConfig,
    fused_moe,
    fused_moe_ref,
    moe_config,
)
from r3trace.kernels.moe.gemv import gemv_down_sum, gemv_gate_up

# ---- exploration (--only moe_explore): candidates graph-timed per (E, I, T), each checked against the ref
# GemvTile(up_n, up_k, up_warps, down_n, down_k, down_warps); at T = 1 the up and down kernels are graph-timed apart
# per tile and the best of each composed
GEMV_TILES = [
    GemvTile(8, 512, 4, 16, 256, 4), GemvTile(4, 512, 4, 8, 256, 4), GemvTile(4, 1024, 4, 32, 256, 8),
    GemvTile(16, 512, 8, 16, 512, 8), GemvTile(8, 1024, 8, 8, 512, 4), GemvTile(2, 1024, 4, 4, 256, 4),
    GemvTile(4, 256, 4, 16, 128, 4),
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
                best_gemv = GemvTile(*bu[:3], *bd[3:6])
                cell["gemv_up_ms"] = {str(tuple(g)[:3]): v for g, v in ups.items()}
                cell["gemv_down_ms"] = {str(tuple(g)[3:6]): v for g, v in downs.items()}
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
