"""Fused MoE decode sweep (the gemv path, D = 7168, K = 8, bf16) on one GPU, graph-timed.

Run (GPU): python bench/moe_gemv_sweep.py [--t 1,2,4] [--shapes 256x256,32x2048]
           -> table on stdout, JSON in $OUT/moe_gemv_sweep[--tag].json

Per (E, I, T): each gate_up variant and each down variant graph-timed alone (the down on the act the
committed default computed), the best of each composed, then whole pipelines, the committed default
(`moe_config`) first, each checked against fused_moe_ref before it is timed. Routes are rotated over 8
sets so the touched weights (88 MB per call at E = 256) come from HBM, as bench/kernels.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

import torch
from sibling import load_sibling  # bench/sibling.py: python bench/<script>.py puts bench/ on the path

from r3trace.kernels import moe_gemv as MG
from r3trace.kernels.fused_moe import GemvTile, MoeConfig, fused_moe, fused_moe_ref, moe_config
from r3trace.kernels.moe_gemv import gemv_down_sum, gemv_gate_up

D, K = 7168, 8
OUT = Path(os.environ.get("OUT", "out"))

G = GemvTile
# gate_up variants: (up_n, up_k, up_warps, unroll); the rest of the tile is unused by the up. Run 1-3 of
# bench/NOTES.md "Fused MoE, session 3" also timed an M-16 tl.dot gate_up, a down gathering the K experts as a
# 3D tile or as stacked rows, programmatic dependent launch and a one-launch fused gemv: none won (removed)
UPS = [(4, 1024, 4, False), (1, 1024, 2, True), (2, 1024, 4, True), (2, 2048, 8, True), (1, 2048, 4, True),
       (4, 1024, 4, True), (1, 512, 1, True)]  # fmt: skip
# down variants: (down_n, down_k, down_warps, unroll)
DOWNS = [(4, 256, 4, False), (4, 256, 2, True), (8, 256, 4, True), (4, 256, 4, True), (1, 256, 1, True),
         (2, 256, 1, True)]  # fmt: skip


def up_tile(u: tuple) -> GemvTile:
    return G(u[0], u[1], u[2], 4, 256, 4, unroll=u[3])


def down_tile(d: tuple) -> GemvTile:
    return G(4, 1024, 4, d[0], d[1], d[2], unroll=d[3])


def compose(u: tuple, d: tuple) -> GemvTile | None:
    """One tile for both kernels; None where they disagree on `unroll` (one flag drives both)."""
    return G(*u[:3], *d[:3], unroll=d[3]) if u[3] == d[3] else None


def regs() -> dict[str, list[int]]:
    """Registers and spills of every gemv kernel compiled in this process (best effort: Triton internals)."""
    out: dict[str, list[int]] = {}
    for fn in (MG._gemv_gate_up_kernel, MG._gemv_down_sum_kernel):
        try:
            for cache in fn.device_caches.values():
                for k in cache[0].values():
                    c = getattr(k.src, "constants", {}) or {}
                    keys = ("BLOCK_N", "BLOCK_K", "KDIM_UNROLL")
                    sel = [v for key, v in c.items() if str(key[-1] if isinstance(key, tuple) else key) in keys]
                    name = f"{k.name} {sel} w{k.metadata.num_warps} s{k.metadata.num_stages}"
                    out[name] = [k.n_regs, k.n_spills]
        except Exception as e:  # internals moved: skip, the timings stand alone
            out[f"{fn.__name__} error"] = [0, 0]
            print(f"regs: {type(e).__name__}: {e}")
    return out


BK = load_sibling("kernels.py", "bench_kernels")


def _prewarm(job: tuple[GemvTile, int]) -> str:
    """Compile one gemv pipeline (both kernels) into Triton's disk cache in a worker process."""
    tile, I = job
    E = 8
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16)
    fused_moe(x, w13, w2, BK._routes(1, E, 1)[0], torch.rand(1, K, device="cuda"), config=MoeConfig(16, *_g(), tile))
    torch.cuda.synchronize()
    return str(tile)


def _g() -> tuple:
    base = moe_config(8, 256, 2, 256)
    return base.gate_up, base.down


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep(E: int, I: int, T: int, copy_gbs: float, out: list) -> None:
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) / D**0.5
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) / I**0.5
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids_sets = BK._routes(T, E, 8)
    wts = torch.rand(T, K, device="cuda")
    touched = torch.unique(ids_sets[0]).numel()
    read_ms = touched * 3 * I * D * 2 / copy_gbs / 1e6
    ref = fused_moe_ref(x, w13, w2, ids_sets[0], wts)
    default = moe_config(T * K, E, 2, I, tokens=T)
    cell: dict[str, object] = {"E": E, "I": I, "T": T, "touched_read_ms": read_ms, "default": BK._cfg_str(default)}
    base_g = default.gemv or G(4, 1024, 4, 4, 256, 4)
    acts = [gemv_gate_up(x, w13, ids, base_g) for ids in ids_sets]
    down_ref = gemv_down_sum(acts[0], w2, ids_sets[0], wts, base_g)
    ups, downs = {}, {}
    if T == 1 or E == 256:
        for u in UPS:
            g = up_tile(u)
            try:
                err = rel(gemv_gate_up(x, w13, ids_sets[0], g), acts[0])
                ups[u] = BK.ms_graph([partial(gemv_gate_up, x, w13, ids, g) for ids in ids_sets])
            except Exception as e:
                print(f"  up {u} failed: {type(e).__name__}: {str(e)[:160]}")
                continue
            print(f"E={E} I={I} T={T} up {u}: {ups[u]:.4f} ms ({59e-3 * I / 256 * touched / 8 / ups[u]:.2f} TB/s) "
                  f"err vs default {err:.1e}")  # fmt: skip
        for d in DOWNS:
            g = down_tile(d)
            try:
                err = rel(gemv_down_sum(acts[0], w2, ids_sets[0], wts, g), down_ref)
                downs[d] = BK.ms_graph([partial(gemv_down_sum, a, w2, ids, wts, g)
                                        for a, ids in zip(acts, ids_sets, strict=True)])  # fmt: skip
            except Exception as e:
                print(f"  down {d} failed: {type(e).__name__}: {str(e)[:160]}")
                continue
            print(f"E={E} I={I} T={T} down {d}: {downs[d]:.4f} ms ({29e-3 * I / 256 * touched / 8 / downs[d]:.2f} "
                  f"TB/s) err vs default {err:.1e}")  # fmt: skip
    cell["up_ms"] = {str(k): v for k, v in ups.items()}
    cell["down_ms"] = {str(k): v for k, v in downs.items()}
    cands = [default]
    if ups and downs:
        bd = min(downs, key=downs.__getitem__)
        bu = min((u for u in ups if compose(u, bd)), key=ups.__getitem__, default=UPS[0])
        g = compose(bu, bd)
        cands += [default._replace(gemv=g)] if g is not None else []
    res = {}
    for cfg in dict.fromkeys(cands):
        fns = [partial(fused_moe, x, w13, w2, ids, wts, config=cfg) for ids in ids_sets]
        try:
            err = rel(fns[0](), ref)
            tg = BK.ms_graph(fns)
        except Exception as e:
            print(f"  {BK._cfg_str(cfg)} failed: {type(e).__name__}: {str(e)[:160]}")
            continue
        res[BK._cfg_str(cfg)] = {"graph_ms": tg, "x_read": tg / read_ms, "rel_err": err}
        print(f"E={E:>3} I={I:>4} T={T} {BK._cfg_str(cfg):>110} graph {tg:.4f} ms x read {tg / read_ms:.2f} "
              f"err {err:.1e}")  # fmt: skip
    cell["pipelines"] = res
    out.append(cell)
    del w13, w2
    torch.cuda.empty_cache()


def floors() -> dict[str, float]:
    """A replay's fixed cost: graphs of one and two tiny kernels (no HBM traffic to speak of)."""
    z = torch.zeros(1024, device="cuda")
    one = BK.ms_graph([partial(z.add_, 1.0)])
    two = BK.ms_graph([lambda: (z.add_(1.0), z.mul_(1.0))])
    print(f"graph floor: one tiny kernel {one:.4f} ms, two {two:.4f} ms")
    return {"one_kernel_ms": one, "two_kernels_ms": two}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", default="1", help="token counts")
    ap.add_argument("--shapes", default="256x256", help="ExI list")
    ap.add_argument("--prewarm", type=int, default=12, help="compile processes (0: off)")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    a = ap.parse_args()
    t0 = time.time()
    copy_gbs, _ = BK.ceilings()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if a.prewarm:
        tiles = {up_tile(u) for u in UPS} | {down_tile(d) for d in DOWNS}
        BK._prewarm_pool(_prewarm, sorted({(t, I) for t in tiles for _, I in shapes}, key=str), a.prewarm)
    res: dict[str, object] = {"ceilings": BK.RESULTS["ceilings"], "floors": floors()}
    cells: list = []
    res["cells"] = cells
    for E, I in shapes:
        for T in [int(t) for t in a.t.split(",")]:
            sweep(E, I, T, copy_gbs, cells)
            OUT.mkdir(parents=True, exist_ok=True)
            res["regs"] = regs()
            (OUT / f"moe_gemv_sweep{a.tag}.json").write_text(json.dumps(res, indent=1))
    print(f"sweep wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
