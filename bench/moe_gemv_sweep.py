"""Fused MoE decode sweep (the gemv path, D = 7168, K = 8, bf16) on one GPU, graph-timed.

Run (GPU): python bench/moe_gemv_sweep.py [--cells 256x256x1,256x256x2,256x256x4,32x2048x1] [--tag -x]
           -> table on stdout, JSON in $OUT/moe_gemv_sweep[--tag].json

Per cell (E x I x T): whole pipelines, the committed default (`moe_config`) first, then the default with each
w2 prefetch variant (`GemvTile.w2_prefetch` x `up_evict_first`), each checked against fused_moe_ref before it
is timed. At E = 256 / T = 1 also: each up alone (what the prefetch costs the up), each down tile alone from
HBM and as the second of two back-to-back calls on the same inputs (its w2 then sits in L2: the marginal cost
is the down's L2-resident time plus one graph node), and the best prefetch variant with each down tile.
Floors: graphs of one and two tiny kernels, and the gemv pipeline on all-(-1) routes (both grids launched,
every program returns or masks its loads: no weight traffic). Routes are rotated over 8 sets and do_bench
clears the L2 before every replay, so the touched weights (88 MB per call at E = 256) come from HBM, as
bench/kernels.py does.
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
from r3trace.kernels.moe_config import GEMV_T1
from r3trace.kernels.moe_gemv import gemv_down_sum, gemv_gate_up

D, K = 7168, 8
OUT = Path(os.environ.get("OUT", "out"))

G = GemvTile
# Session 3 (bench/NOTES.md "Fused MoE, session 3", runs 1-3) swept 16 up and 10 down tiles, an M-16 tl.dot
# gate_up, a down gathering the K experts as a 3D tile or as stacked rows, programmatic dependent launch and a
# one-launch fused gemv: none beat the committed tiles (removed). Session 4: w2 asked into the L2 by the up.
PREFETCHES = [("", False), ("", True), ("bulk", False), ("bulk", True), ("bulk_last", False), ("bulk_last", True),
              ("lines", False), ("lines", True)]  # fmt: skip
# down variants: (down_n, down_k, down_warps); the committed T = 1 down first
DOWNS = [(4, 256, 2), (2, 256, 1), (8, 256, 4), (4, 256, 4), (1, 256, 1), (8, 256, 2)]


def with_prefetch(tile: GemvTile, pf: tuple[str, bool]) -> GemvTile:
    return tile._replace(w2_prefetch=pf[0], up_evict_first=pf[1])


def down_tile(base: GemvTile, d: tuple) -> GemvTile:
    return base._replace(down_n=d[0], down_k=d[1], down_warps=d[2])


def pf_str(pf: tuple[str, bool]) -> str:
    return f"{pf[0] or 'no prefetch'}{' + w13 evict_first' if pf[1] else ''}"


def regs() -> dict[str, list[int]]:
    """Registers and spills of every gemv kernel compiled in this process (best effort: Triton internals)."""
    out: dict[str, list[int]] = {}
    for fn in (MG._gemv_gate_up_kernel, MG._gemv_down_sum_kernel):
        try:
            for cache in fn.device_caches.values():
                for k in cache[0].values():
                    c = getattr(k.src, "constants", {}) or {}
                    keys = ("BLOCK_N", "BLOCK_K", "KDIM_UNROLL", "PREFETCH", "EVICT")
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


def _downs(n: int, act: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, g: GemvTile) -> None:
    """The down n times on the same inputs (from the second call on, its w2 is in L2)."""
    for _ in range(n):
        gemv_down_sum(act, w2, ids, wts, g)


def _pipeline(name: str, cfg: MoeConfig, x, w13, w2, ids_sets, wts, ref, read_ms: float, res: dict, tag: str) -> None:
    fns = [partial(fused_moe, x, w13, w2, ids, wts, config=cfg) for ids in ids_sets]
    try:
        err = rel(fns[0](), ref)
        tg = BK.ms_graph(fns)
    except Exception as e:
        print(f"  {name} failed: {type(e).__name__}: {str(e)[:160]}")
        return
    res[name] = {"config": BK._cfg_str(cfg), "graph_ms": tg, "x_read": tg / read_ms, "rel_err": err}
    print(f"{tag} {name:>58} graph {tg:.4f} ms x read {tg / read_ms:.2f} err {err:.1e}")


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
    tag = f"E={E:>3} I={I:>4} T={T}"
    cell: dict[str, object] = {"E": E, "I": I, "T": T, "touched_read_ms": read_ms, "default": BK._cfg_str(default)}
    base = default.gemv or GEMV_T1
    res: dict[str, dict] = {}
    _pipeline("default", default, x, w13, w2, ids_sets, wts, ref, read_ms, res, tag)
    for pf in PREFETCHES:
        cfg = default._replace(gemv=with_prefetch(base, pf))
        if cfg != default:
            _pipeline(pf_str(pf), cfg, x, w13, w2, ids_sets, wts, ref, read_ms, res, tag)
    if T == 1 and E == 256:
        mb_up, mb_down = touched * 2 * I * D * 2 / 1e6, touched * I * D * 2 / 1e6
        acts = [gemv_gate_up(x, w13, ids, base) for ids in ids_sets]
        ups: dict[str, float] = {}
        for pf in PREFETCHES:
            g = with_prefetch(base, pf)
            err = rel(gemv_gate_up(x, w13, ids_sets[0], g, w2), acts[0])
            ups[pf_str(pf)] = t = BK.ms_graph([partial(gemv_gate_up, x, w13, ids, g, w2) for ids in ids_sets])
            print(f"{tag} up alone, {pf_str(pf):>34}: {t:.4f} ms ({mb_up / 1e3 / t:.2f} TB/s of w13) err {err:.1e}")
        downs: dict[str, dict[str, float]] = {}
        down_ref = gemv_down_sum(acts[0], w2, ids_sets[0], wts, base)
        for d in DOWNS:
            g = down_tile(base, d)
            err = rel(gemv_down_sum(acts[0], w2, ids_sets[0], wts, g), down_ref)
            pairs = list(zip(acts, ids_sets, strict=True))
            one = BK.ms_graph([partial(_downs, 1, a, w2, ids, wts, g) for a, ids in pairs])
            two = BK.ms_graph([partial(_downs, 2, a, w2, ids, wts, g) for a, ids in pairs])
            downs[str(d)] = {"hbm_ms": one, "second_call_ms": two - one}
            print(f"{tag} down alone {d}: {one:.4f} ms ({mb_down / 1e3 / one:.2f} TB/s); second call on L2-resident "
                  f"w2 +{two - one:.4f} ms; err {err:.1e}")  # fmt: skip
        cell["up_ms"], cell["down_ms"] = ups, downs
        pfs = [k for k in res if k not in ("default", pf_str(("", False)), pf_str(("", True)))]
        if pfs:
            best = min(pfs, key=lambda k: res[k]["graph_ms"])
            pf = next(p for p in PREFETCHES if pf_str(p) == best)
            for d in DOWNS[1:]:
                cfg = default._replace(gemv=down_tile(with_prefetch(base, pf), d))
                _pipeline(f"{best}, down {d}", cfg, x, w13, w2, ids_sets, wts, ref, read_ms, res, tag)
    cell["pipelines"] = res
    out.append(cell)
    del w13, w2
    torch.cuda.empty_cache()


def floors(I: int) -> dict[str, float]:
    """A replay's fixed cost: graphs of one and two tiny kernels (no HBM traffic to speak of), and the
    default gemv pipeline at E = 256, T = 1 on routes of -1 only (its two grids, no weight traffic)."""
    z = torch.zeros(1024, device="cuda")
    one = BK.ms_graph([partial(z.add_, 1.0)])
    two = BK.ms_graph([lambda: (z.add_(1.0), z.mul_(1.0))])
    w13 = torch.randn(8, 2 * I, D, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(8, D, I, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    none = torch.full((1, K), -1, device="cuda", dtype=torch.int32)
    cfg = moe_config(K, 256, 2, I, tokens=1)
    empty = BK.ms_graph([partial(fused_moe, x, w13, w2, none, torch.rand(1, K, device="cuda"), config=cfg)])
    print(f"graph floor: one tiny kernel {one:.4f} ms, two {two:.4f} ms, gemv pipeline on ids -1 {empty:.4f} ms")
    return {"one_kernel_ms": one, "two_kernels_ms": two, "gemv_empty_ms": empty}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="256x256x1", help="ExIxT list")
    ap.add_argument("--prewarm", type=int, default=12, help="compile processes (0: off)")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    a = ap.parse_args()
    t0 = time.time()
    copy_gbs, _ = BK.ceilings()
    cells_in = [tuple(int(v) for v in c.split("x")) for c in a.cells.split(",")]
    if a.prewarm:
        jobs = {(with_prefetch(moe_config(K * T, E, 2, I, tokens=T).gemv or GEMV_T1, pf), I) for E, I, T in cells_in
                for pf in PREFETCHES} | {(down_tile(GEMV_T1, d), 256) for d in DOWNS}  # fmt: skip
        BK._prewarm_pool(_prewarm, sorted(jobs, key=str), a.prewarm)
    res: dict[str, object] = {"ceilings": BK.RESULTS["ceilings"], "floors": floors(256)}
    cells: list = []
    res["cells"] = cells
    for E, I, T in cells_in:
        sweep(E, I, T, copy_gbs, cells)
        OUT.mkdir(parents=True, exist_ok=True)
        res["regs"] = regs()
        (OUT / f"moe_gemv_sweep{a.tag}.json").write_text(json.dumps(res, indent=1))
    print(f"sweep wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
