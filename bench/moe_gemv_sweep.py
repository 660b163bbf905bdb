"""Fused MoE decode sweep (the gemv path, D = 7168, K = 8, bf16) on one GPU, graph-timed.

Run (GPU): python bench/moe_gemv_sweep.py [--cells 256x256x1,256x256x2,256x256x4,32x2048x1] [--tag=-x]
           -> table on stdout, JSON in $OUT/moe_gemv_sweep[--tag].json

Per cell (E x I x T): whole pipelines, the committed default (`moe_config`) first, then the default's tile
with each pair of (`up_evict_first`, `down_evict_first`), each checked against fused_moe_ref before it is
timed. At E = 256 / T = 1 also: up tiles alone, down tiles alone from HBM and as the second of two
back-to-back calls on the same inputs (its w2 then sits in L2), and the best up + best down composed.
Floors: graphs of one and two tiny kernels, and the gemv pipeline on all-(-1) routes (both grids launched,
every program returns or masks its loads: no weight traffic).

Two timings of the same graphs, routes rotated over 8 sets so the touched weights (88 MB per call at E = 256)
come from HBM: `graph_ms`, bench/kernels.py's (do_bench: the L2 cleared before each replay by zeroing 256 MB,
which leaves it full of dirty lines that a kernel reading 88 MB must write back), and `clean_ms` (the L2 filled
before each replay by reading 256 MB: clean lines, nothing to write back, closer to a decode step where the
kernels before the MoE mostly read).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

import torch
from moe_bench import _cfg_str, _prewarm_pool, _routes  # bench/: python bench/<script>.py puts it on the path
from timing import RESULTS, ceilings, ms, ms_graph

from r3trace.kernels.moe import gemv as MG
from r3trace.kernels.moe.config import GEMV_T1
from r3trace.kernels.moe.fused_moe import GemvTile, MoeConfig, fused_moe, fused_moe_ref, moe_config
from r3trace.kernels.moe.gemv import gemv_down_sum, gemv_gate_up

D, K = 7168, 8
OUT = Path(os.environ.get("OUT", "out"))

G = GemvTile
# Session 3 (bench/NOTES.md "Fused MoE, session 3", runs 1-3) swept 16 up and 10 down tiles, an M-16 tl.dot
# gate_up, a down gathering the K experts as a 3D tile or as stacked rows, programmatic dependent launch and a
# one-launch fused gemv: none beat the committed tiles (removed). Session 4 (bench/NOTES.md "moet1, session 4")
# runs 1-2: the up asking w2 into the L2 (cp.async.bulk.prefetch.L2, with evict_last, per-line prefetch) lost in
# every cell, dirty and clean (E = 256 / T = 1: 0.038-0.042 vs 0.036 / 0.034 vs 0.029 ms); up tiles with a whole
# w13 row in flight per program ((1, 4096, 4 / 8 warps), (1, 8192, 8), (2, 4096, 8)) 0.0246-0.0260 alone vs
# 0.0242; downs (8, 256, 2), (2, 256, 1) no better than (4, 256, 2): removed from the lists.
# (up_evict_first, down_evict_first); the first is the session 3 default's
VARIANTS = [(False, False), (True, False), (False, True), (True, True)]
# up tiles at E = 256 / T = 1: (up_n, up_k, up_warps); down tiles: (down_n, down_k, down_warps)
UPS = [(1, 1024, 2)]
DOWNS = [(4, 256, 2), (8, 256, 4)]


def variant(tile: GemvTile, v: tuple[bool, bool]) -> GemvTile:
    return tile._replace(up_evict_first=v[0], down_evict_first=v[1])


def up_tile(base: GemvTile, u: tuple) -> GemvTile:
    return base._replace(up_n=u[0], up_k=u[1], up_warps=u[2])


def down_tile(base: GemvTile, d: tuple) -> GemvTile:
    return base._replace(down_n=d[0], down_k=d[1], down_warps=d[2])


def v_str(v: tuple[bool, bool]) -> str:
    return " + ".join(["w13 evict_first"] * v[0] + ["w2 evict_first"] * v[1]) or "no hints"


def graphs(fns: list) -> list[torch.cuda.CUDAGraph]:
    """One CUDA graph per input set (as bench/kernels.py's ms_graph captures them)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()  # warm: compile outside capture
    torch.cuda.synchronize()
    out = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        out.append(g)
    return out


FLUSH: list[torch.Tensor] = []


def times(fns: list, reps: int = 200) -> tuple[float, float]:
    """(graph_ms, clean_ms) of replays rotated over one graph per input set: do_bench's median (L2 zeroed
    before each: dirty) and a median of event pairs with the L2 filled by a 256 MB read before each (clean)."""
    gs = graphs(fns)
    i = [0]

    def replay() -> None:
        gs[i[0] % len(gs)].replay()
        i[0] += 1

    dirty = ms(replay)
    if not FLUSH:
        FLUSH.extend([torch.ones(2**26, device="cuda"), torch.empty((), device="cuda")])  # 256 MB fp32, a sink
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps + 10)]
    for j, (start, end) in enumerate(ev):
        torch.sum(FLUSH[0], dim=0, out=FLUSH[1])  # reads 256 MB: the L2 holds clean lines of it
        start.record()
        gs[j % len(gs)].replay()
        end.record()
    torch.cuda.synchronize()
    clean = sorted(s.elapsed_time(e) for s, e in ev[10:])[reps // 2]
    return dirty, clean


def regs() -> dict[str, list[int]]:
    """Registers and spills of every gemv kernel compiled in this process (best effort: Triton internals)."""
    out: dict[str, list[int]] = {}
    for fn in (MG._gemv_gate_up_kernel, MG._gemv_down_sum_kernel):
        try:
            for cache in fn.device_caches.values():
                for k in cache[0].values():
                    c = getattr(k.src, "constants", {}) or {}
                    keys = ("BLOCK_N", "BLOCK_K", "KDIM_UNROLL", "EVICT")
                    sel = [v for key, v in c.items() if str(key[-1] if isinstance(key, tuple) else key) in keys]
                    name = f"{k.name} {getattr(k, 'hash', '')[:8]} {sel} w{k.metadata.num_warps}"
                    out[name] = [k.n_regs, k.n_spills]
        except Exception as e:  # internals moved: skip, the timings stand alone
            out[f"{fn.__name__} error"] = [0, 0]
            print(f"regs: {type(e).__name__}: {e}")
    return out




def _prewarm(job: tuple[GemvTile, int]) -> str:
    """Compile one gemv pipeline (both kernels) into Triton's disk cache in a worker process."""
    tile, I = job
    E = 8
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16)
    fused_moe(x, w13, w2, _routes(1, E, 1)[0], torch.rand(1, K, device="cuda"), config=MoeConfig(16, *_g(), tile))
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
        tg, tc = times(fns)
    except Exception as e:
        print(f"  {name} failed: {type(e).__name__}: {str(e)[:160]}")
        return
    res[name] = {"config": _cfg_str(cfg), "graph_ms": tg, "clean_ms": tc, "x_read": tg / read_ms,
                 "x_read_clean": tc / read_ms, "rel_err": err}  # fmt: skip
    print(f"{tag} {name:>52} graph {tg:.4f} ms ({tg / read_ms:.2f}x) clean {tc:.4f} ms ({tc / read_ms:.2f}x) "
          f"err {err:.1e}")  # fmt: skip


def sweep(E: int, I: int, T: int, copy_gbs: float, out: list) -> None:
    w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) / D**0.5
    w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) / I**0.5
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    ids_sets = _routes(T, E, 8)
    wts = torch.rand(T, K, device="cuda")
    touched = torch.unique(ids_sets[0]).numel()
    read_ms = touched * 3 * I * D * 2 / copy_gbs / 1e6
    ref = fused_moe_ref(x, w13, w2, ids_sets[0], wts)
    default = moe_config(T * K, E, 2, I, tokens=T)
    tag = f"E={E:>3} I={I:>4} T={T}"
    cell: dict[str, object] = {"E": E, "I": I, "T": T, "touched_read_ms": read_ms, "default": _cfg_str(default)}
    base = default.gemv or GEMV_T1
    res: dict[str, dict] = {}
    _pipeline("default", default, x, w13, w2, ids_sets, wts, ref, read_ms, res, tag)
    for v in VARIANTS:
        cfg = default._replace(gemv=variant(base, v))
        if cfg != default:
            _pipeline(v_str(v), cfg, x, w13, w2, ids_sets, wts, ref, read_ms, res, tag)
    if T == 1 and E == 256:
        mb_up, mb_down = touched * 2 * I * D * 2 / 1e6, touched * I * D * 2 / 1e6
        acts = [gemv_gate_up(x, w13, ids, base) for ids in ids_sets]
        ups: dict[str, list[float]] = {}
        for u in UPS:
            for ef in (False, True):
                g = up_tile(base, u)._replace(up_evict_first=ef)
                err = rel(gemv_gate_up(x, w13, ids_sets[0], g), acts[0])
                ups[f"{u} {ef}"] = list(times([partial(gemv_gate_up, x, w13, ids, g) for ids in ids_sets]))
                tg, tc = ups[f"{u} {ef}"]
                print(f"{tag} up alone {u} evict_first {ef}: {tg:.4f} ms ({mb_up / 1e3 / tg:.2f} TB/s) clean {tc:.4f} "
                      f"err {err:.1e}")  # fmt: skip
        downs: dict[str, list[float]] = {}
        down_ref = gemv_down_sum(acts[0], w2, ids_sets[0], wts, base)
        pairs = list(zip(acts, ids_sets, strict=True))
        for d in DOWNS:
            for ef in (False, True):
                g = down_tile(base, d)._replace(down_evict_first=ef)
                err = rel(gemv_down_sum(acts[0], w2, ids_sets[0], wts, g), down_ref)
                one = times([partial(_downs, 1, a, w2, ids, wts, g) for a, ids in pairs])
                two = ms_graph([partial(_downs, 2, a, w2, ids, wts, g) for a, ids in pairs])
                downs[f"{d} {ef}"] = [*one, two - one[0]]
                print(
                    f"{tag} down alone {d} evict_first {ef}: {one[0]:.4f} ms ({mb_down / 1e3 / one[0]:.2f} TB/s) "
                    f"clean {one[1]:.4f}; a second call on L2-resident w2 +{two - one[0]:.4f} ms; err {err:.1e}"
                )
        cell["up_ms"], cell["down_ms"] = ups, downs  # [graph, clean(, second call)]
        bu, be = min(ups, key=lambda k: ups[k][0]).rsplit(" ", 1)
        bd, bde = min(downs, key=lambda k: downs[k][0]).rsplit(" ", 1)
        u, d = next(u for u in UPS if str(u) == bu), next(d for d in DOWNS if str(d) == bd)
        g = down_tile(up_tile(base, u), d)._replace(up_evict_first=be == "True", down_evict_first=bde == "True")
        _pipeline(f"best up {bu} ef {be}, down {bd} ef {bde}", default._replace(gemv=g), x, w13, w2, ids_sets, wts,
                  ref, read_ms, res, tag)  # fmt: skip
    cell["pipelines"] = res
    out.append(cell)
    del w13, w2
    torch.cuda.empty_cache()


def floors(I: int) -> dict[str, list[float]]:
    """A replay's fixed cost, [graph, clean] ms: graphs of one and two tiny kernels (no HBM traffic to speak
    of), and the default gemv pipeline at E = 256, T = 1 on routes of -1 only (its two grids, no weight traffic)."""
    z = torch.zeros(1024, device="cuda")
    one = times([partial(z.add_, 1.0)])
    two = times([lambda: (z.add_(1.0), z.mul_(1.0))])
    w13 = torch.randn(8, 2 * I, D, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(8, D, I, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
    none = torch.full((1, K), -1, device="cuda", dtype=torch.int32)
    cfg = moe_config(K, 256, 2, I, tokens=1)
    empty = times([partial(fused_moe, x, w13, w2, none, torch.rand(1, K, device="cuda"), config=cfg)])
    print(f"graph floor [graph, clean] ms: one tiny kernel {one}, two {two}, gemv pipeline on ids -1 {empty}")
    return {"one_kernel_ms": list(one), "two_kernels_ms": list(two), "gemv_empty_ms": list(empty)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="256x256x1", help="ExIxT list")
    ap.add_argument("--prewarm", type=int, default=12, help="compile processes (0: off)")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    a = ap.parse_args()
    t0 = time.time()
    copy_gbs, _ = ceilings()
    cells_in = [tuple(int(v) for v in c.split("x")) for c in a.cells.split(",")]
    if a.prewarm:
        jobs = {(variant(moe_config(K * T, E, 2, I, tokens=T).gemv or GEMV_T1, v), I) for E, I, T in cells_in
                for v in VARIANTS}  # fmt: skip
        jobs |= {(up_tile(GEMV_T1, u)._replace(up_evict_first=ef), 256) for u in UPS for ef in (False, True)}
        jobs |= {(down_tile(GEMV_T1, d)._replace(down_evict_first=ef), 256) for d in DOWNS for ef in (False, True)}
        _prewarm_pool(_prewarm, sorted(jobs, key=str), a.prewarm)
    res: dict[str, object] = {"ceilings": RESULTS["ceilings"], "floors": floors(256)}
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
