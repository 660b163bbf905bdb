"""H = 128 MLA decode on Hopper: the Gluon stage 1 at several split policies, graph-timed, against a bf16
GEMM ceiling measured in the same run (issue 6 point 8: >= 50% of it at kv_len >= 8k).

Run (GPU): python bench/mla_decode_h128.py [--old-gluon PATH]   -> table on stdout, JSON in $OUT/mla_decode_h128.json

The ceiling: the 8192^3 bf16 GEMM is timed right before and right after every cell (each cell's "after" is
the next one's "before"), with the UTC time of each; every cell is reported against both adjacent figures and
judged against the higher (same clocks, the stricter). --smi: nvidia-smi samples the SM clock, power and
temperature every 200 ms into $OUT/smi.csv meanwhile (read-only queries), to tell clock throttling from
other drift.

The default tile is the engine's for 64-slot pages (default_decode_tile(..., page_size=64): since session 11 the
seesaw stage 1, mla_decode_seesaw.py; `--tiles wide=kernel:wide` times the wide kernel's TMA form beside it).
--old-gluon, --variants and --parts swap parts of the wide kernel (mla_decode_gluon.py) and time them on the same
tile run by it (cell key "wide" is that kernel unchanged); `--variants TMA=0` times its cp.async form (the session-4
default). Error checks: page size 1 (the engine's page-1 tile: the wide kernel's cp.async form) and 64 (TMA) against
the fp32 reference.

--cluster P: the default's call with DecodeTile.cluster = P beside it (at a split count of 2, 4 or 8 up to P the
splits merge inside thread-block clusters, kernels/cluster_merge.py; elsewhere the same call). --pdl: the default
launched as programmatic dependents (DecodeTile.pdl) beside it. --tiles NAME=field:value+field:value,...: the default
with those DecodeTile fields replaced, beside it (e.g. `pdl=pdl:1,nodirect=direct:0+pdl:1`; digits are ints).
--cells BxL,...

--old-gluon: a previous kernels/mla_decode_gluon.py (e.g. `git show <rev>:kernels/mla_decode_gluon.py`), timed
at the default's split count in the same run, its stage 1 swapped in for the installed one.

At the cells where the default takes one split, the same call through the two-stage twin
(DecodeTile.direct=False: fp32 partial, then the merge launch) is timed too.

--parts: where a tile's time goes. The TMA form's tile (kernels/wide_tile.py) with one part cut out (PARTS: the
score wgmmas, the P V wgmmas, the exponentials, the rescale of O, or every tile loaded from the same L2-hot rows), each
timed at B = 16 / 8k and 64 / 8k beside the whole kernel; the results are wrong, only the times count. Also
stage 2 (the merge) alone, graph-timed, at every cell's default split count. --variants NAME=0|1,...: the
stage 1 with those DecodeTile schedule fields (max_xchg, gather_under_s, coalesced_out) too, at the default splits.

Split policies (decode_tile.py): the launcher default (splits_by_cost), 8 programs per SM rounded up (the
session-3 default) and 4 / 2 / 1 rounded down (whole waves). Run 6 also timed a 32-key x 4-stage schedule
with the next tile's scores under P V (17-22% slower; removed). B = 48 / 8k checks the cost model off the
fitted cells (96 programs a split: one split leaves 36 SMs idle). FLOPs = 2 B H L (576 + 512); the cache
(B L 1152 bytes) is >= 150 MB, 2.5x the 60 MB L2, at kv_len >= 8k, so no rotation (the kv_len 1k cells at
B <= 64, 19-75 MB, partly hit L2: not goal cells).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from sibling import load_path, load_sibling  # bench/sibling.py: python bench/<script>.py puts bench/ on the path
from triton.testing import do_bench

from r3trace.kernels.mla_decode import DecodeTile, default_decode_tile, mla_decode, mla_decode_ref, wide_tile
from r3trace.kernels.mla_decode import wide as mla_decode_gluon

H, KV_LORA, ROPE = 128, 512, 64
CELLS = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)] + [(48, 8192)]
WAVES = [(8, False), (4, True), (2, True), (1, True)]  # (programs per SM, whole waves)


def stage1_ms(sw: ModuleType, stage1: Callable[..., bool], fn: partial[torch.Tensor]) -> float:
    """fn timed with `stage1` as the wide record's launcher (mla_decode looks the record up per call)."""
    record = mla_decode_gluon.STAGE1
    mla_decode_gluon.STAGE1 = record._replace(launch=stage1)
    try:
        return float(sw.ms(fn))
    finally:
        mla_decode_gluon.STAGE1 = record


def with_fields(**fields: bool) -> Callable[..., bool]:
    """The wide launcher with these DecodeTile schedule fields (max_xchg, gather_under_s, coalesced_out) set."""

    def launch(*args: object, **kwargs: object) -> bool:
        tile = args[9]
        assert isinstance(tile, DecodeTile)
        return mla_decode_gluon.mla_decode_stage1_wide(*args[:9], tile._replace(**fields), *args[10:], **kwargs)

    return launch


# (name, [(source text, replacement), ...]): one part of the TMA form's tile (kernels/wide_tile.py) cut out (each
# replaced text must occur exactly once); the results are wrong, only the times count
SCORES = (
    "    s = warpgroup_mma(qv_s, kv_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)\n"
    "    return warpgroup_mma(qr_s, kr_t.permute((1, 0)), s, is_async=True)\n"
)
PARTS: list[tuple[str, list[tuple[str, str]]]] = [
    ("no_scores", [(SCORES, "    return s_zero + 0.0\n"), ("    s = warpgroup_mma_wait(0, deps=(s,))\n", "")]),
    ("no_pv", [("    acc = warpgroup_mma(p_s, kv_t, acc, is_async=True)\n", "")]),
    ("no_exp", [("    p = gl.exp2(s - m_new[:, None])\n", "    p = s - m_new[:, None]\n")]),
    ("no_rescale", [("    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]\n", "")]),
    # every tile loads tile 1's rows (L2-hot after the first): what HBM latency and bandwidth cost
    ("l2_tiles", [("    slot_n2 = first_slot(r2t, n2, end)\n", "    slot_n2 = slot_n + 0 * n2\n")]),
]  # fmt: skip
# No barrier cuts: with any of the 3 removed, triton 3.6's barrier analysis puts one back (PTX: 3 a tile still).
TILE_IMPORT = "from r3trace.kernels.mla_decode.wide_tile import"


def cut_stage1s(out_dir: Path) -> dict[str, Callable[..., None]]:
    """The installed stage 1 ("whole") and one per PARTS cut: kernels/wide_tile.py with the cut, loaded as its own
    module, and a copy of kernels/mla_decode_gluon.py importing its tile steps from it (their own JIT cache
    entries)."""
    tile_src = Path(wide_tile.__file__).read_text()
    kernel_src = Path(mla_decode_gluon.__file__).read_text()
    assert kernel_src.count(TILE_IMPORT) == 1
    mods: dict[str, Callable[..., bool]] = {"whole": mla_decode_gluon.mla_decode_stage1_wide}
    for name, cuts in PARTS:
        cut = tile_src
        for old, new in cuts:
            assert cut.count(old) == 1, name
            cut = cut.replace(old, new)
        tile_name = f"wide_tile_{name}"
        (out_dir / f"{tile_name}.py").write_text(cut)
        sys.modules[tile_name] = load_path(out_dir / f"{tile_name}.py", tile_name)  # what the copy imports
        path = out_dir / f"gluon_{name}.py"
        path.write_text(kernel_src.replace(TILE_IMPORT, f"from {tile_name} import"))
        mods[name] = load_path(path, f"gluon_{name}").mla_decode_stage1_wide
    return mods


def wide_tile_of(tile: DecodeTile) -> DecodeTile:
    """The same tile run by the wide kernel (mla_decode_gluon.py): what --old-gluon, --variants and --parts swap parts
    of, since the default on 64-slot pages is the seesaw kernel."""
    return tile._replace(kernel="wide")


def parts(sw: ModuleType, out_dir: Path, res: dict[str, object]) -> None:
    """Each PARTS cut timed against the whole (wide) kernel at two cells, then stage 2 alone at every cell."""
    out: dict[str, object] = {}
    mods = cut_stage1s(out_dir)
    default = wide_tile_of(default_decode_tile(H, torch.bfloat16, use_gluon=True, page_size=sw.PAGE))  # TMA form
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, L in [(16, 8192), (64, 8192)]:
        q, kv, r2t, rows, lens = sw.inputs(B, L, H)
        p = default.num_kv_splits(B, H, L, sms)
        call = partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, p, default)
        times = {name: stage1_ms(sw, fn, call) for name, fn in mods.items()}
        out[f"{B}/{L}"] = times
        print(f"parts B={B} L={L} splits {p}: " + " ".join(f"{k} {v:.4f}" for k, v in times.items()), flush=True)
    for B, L in CELLS:
        p = default.num_kv_splits(B, H, L, sms)
        out[f"merge {B}/{L}"] = t = sw.merge_ms(B, H, p, L, sw.ms)  # graph-timed like the whole call
        print(f"stage 2 alone B={B} L={L} splits {p}: {t:.4f} ms", flush=True)
    res["parts"] = out


class Gemm:
    """The ceiling: bf16 8192^3 torch.matmul, median TFLOP/s, with the UTC time it was taken. It moved 15%
    within one run (789 before the cells, 666 after: session 4, run 4) while the decode kernel repeated
    within 1%, so main() takes it before and after every cell. Operands allocated once (256 MB)."""

    def __init__(self) -> None:
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def __call__(self) -> dict[str, float | str]:
        t = float(do_bench(partial(torch.matmul, self.a, self.b), warmup=25, rep=100, return_mode="median"))
        return {"TFLOPs": 2 * 8192**3 / t / 1e9, "utc": time.strftime("%H:%M:%S", time.gmtime())}


def paged_inputs(heads: int, page: int = 64, seed: int = 64) -> tuple[torch.Tensor, ...]:
    """q, the cache, req_to_token, rows and lengths for 9 requests of mixed odd lengths on `page`-slot shuffled pages
    (3 spare pages of random data): the paged error checks' case."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = [1, 700, 3001, 64, 1500, 33, 2049, 5, 999]
    npages = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(npages) + 3, device="cuda", generator=g)
    r2t = torch.zeros(len(lens), 3008, dtype=torch.int32, device="cuda")
    off = 0
    for b, n in enumerate(lens):
        slots = perm[off : off + npages[b], None] * page + torch.arange(page, device="cuda")
        r2t[b, :n] = slots.reshape(-1)[:n].to(torch.int32)
        off += npages[b]
    q = torch.randn(len(lens), heads, KV_LORA + ROPE, device="cuda", generator=g).bfloat16()
    kv = torch.randn(perm.numel() * page, KV_LORA + ROPE, device="cuda", generator=g).bfloat16()
    return q, kv, r2t, torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda")


def check_paged(tile: DecodeTile, page: int = 64) -> float:
    """Normwise error vs the fp32 reference on `page`-slot shuffled pages (the TMA form's case; sw.check
    uses page size 1): paged_inputs, 7 splits."""
    q, kv, r2t, rows, seq = paged_inputs(H, page, seed=page)
    out = mla_decode(q, kv, r2t, rows, seq, KV_LORA, 576**-0.5, num_kv_splits=7, tile=tile).float()
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq, KV_LORA, 576**-0.5).float()
    return ((out - ref).norm() / ref.norm()).item()


def errors(sw: ModuleType, default: DecodeTile, variants: dict[str, Callable[..., None]]) -> dict[str, float]:
    """The default and each variant (a wide-kernel stage 1, timed on the wide tile): page size 1 (sw.check; the
    engine's page-1 tile, the wide kernel's cp.async form) and 64 (the TMA form)."""
    out: dict[str, float] = {}
    page1 = default_decode_tile(H, torch.bfloat16, use_gluon=True, page_size=1)
    record = mla_decode_gluon.STAGE1
    for name, stage1 in ({"default": record.launch} | variants).items():
        mla_decode_gluon.STAGE1 = record._replace(launch=stage1)
        try:
            out[f"{name} page 1"] = sw.check(page1, H)
            out[f"{name} page 64"] = check_paged(default if name == "default" else wide_tile_of(default))
        finally:
            mla_decode_gluon.STAGE1 = record
        print(f"normwise error vs fp32 ref, {name}: page 1 {out[f'{name} page 1']:.1e}, "
              f"page 64 {out[f'{name} page 64']:.1e}", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-gluon", default="", help="a previous mla_decode_gluon.py, timed at the default splits")
    ap.add_argument("--parts", action="store_true", help="time the kernel with parts cut out; stage 2 alone")
    ap.add_argument("--variants", default="", help="FIELD=0|1[+FIELD=0|1],...: stage 1 with these DecodeTile fields")
    ap.add_argument("--policies", action="store_true", help="also the other split policies (WAVES)")
    ap.add_argument("--smi", action="store_true", help="sample clocks / power to $OUT/smi.csv (nvidia-smi)")
    ap.add_argument("--cluster", type=int, default=0, help="also the default's splits merged in clusters up to this")
    ap.add_argument("--cells", default="", help="BxL,... (default: CELLS)")
    ap.add_argument("--pdl", action="store_true", help="also the default launched as programmatic dependents")
    ap.add_argument("--tiles", default="", help="NAME=field:value+...,...: the default with these fields too")
    args = ap.parse_args()
    tile_options = load_sibling("mla_decode_floor.py", "mla_floor").parse_options(args.tiles) if args.tiles else {}
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")] if args.cells else CELLS
    variants: dict[str, Callable[..., bool]] = {}  # stage 1s timed at the default's splits beside it
    if args.old_gluon:  # a launcher from before the registry: (..., kv_lora, qk_scale, split_align) positionally
        old = load_path(args.old_gluon, "old_gluon").mla_decode_stage1_gluon
        variants["old"] = lambda *a, **k: old(*a[:9], a[9].block_n) is not False  # type: ignore[attr-defined]
    for spec in filter(None, args.variants.split(",")):  # e.g. max_xchg=0 or max_xchg=0+coalesced_out=0
        fields = {name: bool(int(value)) for name, value in (f.split("=") for f in spec.split("+"))}
        variants[spec] = with_fields(**fields)
    sw = load_sibling("mla_decode_sweep.py", "mla_sweep")
    sw.GRAPH = True  # CUDA-graph replays, as the engine decodes
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    smi = None
    if args.smi:  # read-only queries; its timestamps are the host's clock, the GEMMs' utc the same clock
        fields = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv", "-lms", "200"],
                               stdout=(out_dir / "smi.csv").open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    gemm = Gemm()
    gemms = [gemm()]
    default = default_decode_tile(H, torch.bfloat16, use_gluon=True, page_size=sw.PAGE)
    if args.pdl and not default.pdl:  # stage 1 (and the merge) as programmatic dependents: one more --tiles variant
        tile_options["pdl"] = {"pdl": True, "kernel": "wide"}  # the wide kernel's PDL (the seesaw one has none)
    print(f"bf16 GEMM 8192^3 {gemms[0]['TFLOPs']:.0f} TFLOP/s; default tile {tuple(default)}", flush=True)
    res: dict[str, object] = {"default": list(default), "cells": [], "gemms": gemms}
    tiles = {"default": default} | {f"{w}w" + ("" if ww else "-up"): default._replace(fixed_tiles=0, direct=False,
             waves=w, whole_waves=ww) for w, ww in (WAVES if args.policies else [])}  # fmt: skip
    if args.parts:
        parts(sw, out_dir, res)
    res["rel_err"] = errors(sw, default, variants)
    for B, L in cells:
        q, kv, r2t, rows, lens = sw.inputs(B, L, H)
        flops = 2 * B * H * L * (KV_LORA + ROPE + KV_LORA)
        timed: dict[int, float] = {}  # splits -> ms (the same kernel: policies of equal splits timed once)
        policies = {name: tile.num_kv_splits(B, H, L, sms) for name, tile in tiles.items()}
        for name, splits in policies.items():
            if splits not in timed:
                call = partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, splits, tiles[name])
                timed[splits] = sw.ms(call)
        before = float(gemms[-1]["TFLOPs"])
        p = policies["default"]
        call = partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, p, default)
        extra: dict[str, dict[str, float]] = {}  # variants (and the two-stage twin) at the default's splits
        if p == 1:  # the same split count through the two-stage twin (fp32 partial + merge launch)
            two = default._replace(direct=False)
            t_2 = sw.ms(partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, 1, two))
            extra["two_stage"] = {"splits": 1, "ms": t_2, "default_speedup": t_2 / timed[p]}
        if args.cluster and default._replace(cluster=args.cluster) != default:  # cluster_merge.py, where p allows
            clustered = wide_tile_of(default)._replace(cluster=args.cluster)  # the seesaw kernel takes no clusters
            t_c = sw.ms(partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, p, clustered))
            extra["cluster"] = {"splits": p, "ms": t_c, "TFLOPs": flops / t_c / 1e9, "default_speedup": t_c / timed[p]}
        for name, fields in tile_options.items():  # --tiles: DecodeTile fields replaced, at the default's splits
            t_o = sw.ms(partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, p, default._replace(**fields)))
            extra[name] = {"splits": p, "ms": t_o, "TFLOPs": flops / t_o / 1e9, "default_speedup": t_o / timed[p]}
        wide_call = partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, p, wide_tile_of(default))
        for name, stage1 in variants.items():  # wide-kernel stage 1s: against the wide kernel's own time ("wide")
            if "wide" not in extra:
                t_w = sw.ms(wide_call)
                extra["wide"] = {"splits": p, "ms": t_w, "TFLOPs": flops / t_w / 1e9, "default_speedup": t_w / timed[p]}
            t_v = stage1_ms(sw, stage1, wide_call)
            extra[name] = {"splits": p, "ms": t_v, "TFLOPs": flops / t_v / 1e9, "default_speedup": t_v / timed[p]}
        gemms.append(gemm())  # right after the cell: its "after", the next cell's "before"
        after = float(gemms[-1]["TFLOPs"])
        tf = flops / timed[p] / 1e9
        res["cells"].append({  # type: ignore[attr-defined]
            "B": B, "L": L, "policies": policies, "gemm_before": before, "gemm_after": after,
            "verdict_pct": 100 * tf / max(before, after),  # the stricter of the two adjacent ceilings
            "runs": [{"splits": s, "ms": t, "TFLOPs": flops / t / 1e9, "pct_before": 100 * flops / t / 1e9 / before,
                      "pct_after": 100 * flops / t / 1e9 / after} for s, t in timed.items()],
        } | extra)  # fmt: skip
        print(f"B={B} L={L} splits {p}: {timed[p]:.4f} ms {tf:.0f} TFLOP/s = {100 * tf / before:.1f}% of {before:.0f} "
              f"(before) / {100 * tf / after:.1f}% of {after:.0f} (after) at {gemms[-1]['utc']}"
              + "".join(f" | {n} {e['ms']:.4f} (default {e['default_speedup']:.3f}x)" for n, e in extra.items())
              + (" | policies " + " ".join(f"{s}: {t:.4f}" for s, t in timed.items()) if args.policies else ""),
              flush=True)  # fmt: skip
        (out_dir / "mla_decode_h128.json").write_text(json.dumps(res, indent=1))
        del q, kv
        torch.cuda.empty_cache()
    if smi is not None:
        smi.terminate()
    (out_dir / "mla_decode_h128.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
