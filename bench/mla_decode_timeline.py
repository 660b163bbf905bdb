"""Where a narrow Gluon MLA decode call's time goes, per CTA (issue 6, H = 16, the cells merged in clusters).

Run (GPU): python bench/mla_decode_timeline.py [--cells 64x1024,64x8192] [--calls 8] -> $OUT/mla16_timeline.json

The kernel's source (kernels/mla_decode_narrow.py) with clock reads cut in, loaded as its own module (its own JIT
entry, as mla_decode_floor.py --parts does; the output stays right). Each CTA stores %globaltimer (ns, one clock
for the whole GPU) and %clock64 (its SM's cycles) at: t0 entry, t1 past the PDL wait, t2 its loop done, t3 its
output stored; and %smid. They go to a buffer passed as part_lse, which the cluster form never writes. `calls`
calls back to back in one CUDA graph over caches rotated past L2 (as the floor bench times them), replayed; per
middle call: the span (first t0 to last t3), the gap from the previous call's last t3 to this call's first t1 and
last t1, the spread of t1 / t2 / t3 over the CTAs, each CTA's loop (t2 - t1) and tail (t3 - t2) as min / median /
max; and the cluster merge's steps (a copy of cluster_merge_store with %globaltimer stamps: the row sums,
barrier 1, the pushes, barrier 2, the merge, the normalisation, the store) per CTA. The stamps are held in registers
and stored at the end (stored where taken, ptxas spilled ~2 KB a thread); the graph time of the cut and uncut kernels
is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from sibling import load_path, load_sibling
from triton.testing import do_bench

import r3trace.kernels.mla_decode.narrow as mn
from r3trace.kernels.flash import LOG2E
from r3trace.kernels.mla_decode import default_decode_tile, mla_decode

floor = load_sibling("mla_decode_floor.py", "mla_decode_floor")
KV_LORA, ROPE = floor.KV_LORA, floor.ROPE
SLOTS = 16  # int64 a CTA: g0..g3, c0..c3, smid, then the merge's steps (MERGE_STAMPS' slots 9-14)

CLOCKS = """

@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _cycles():
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _smid():
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)
"""
# the kernel's stamps, held in registers (a store of each where it is taken made ptxas spill ~2 KB a thread)
STORE = "".join(
    f"        gl.store(_tp + {i}, {v})\n"
    for i, v in enumerate(["_g0", "_g1", "_g2", "_g3", "_c0", "_c1", "_c2", "_c3"])
)
TP = "part_lse_ptr + (gl.program_id(0) + gl.program_id(1) * gl.num_programs(0)) * 16"
# (text, replacement): each text must occur exactly once in the kernel's source
CUTS = [
    ("    b = gl.program_id(1)\n", "    b = gl.program_id(1)\n    _g0 = _now()\n    _c0 = _cycles()\n"),
    ("    if start < end:  #", "    _g1 = _now()\n    _c1 = _cycles()\n    if start < end:  #"),
    (
        "        l_i = gl.sum(l_e, axis=0)",
        "        _g2 = _now()\n        _c2 = _cycles()\n        l_i = gl.sum(l_e, axis=0)",
    ),
    (
        "    elif CLUSTER > 1:  # no keys",
        f"        _g3 = _now()\n        _c3 = _cycles()\n        _tp = {TP}\n"
        + STORE
        + "        gl.store(_tp + 8, _smid().to(gl.int64))\n    elif CLUSTER > 1:  # no keys",
    ),
    ("            cluster_merge_store(acc,", f"            cluster_merge_store_t({TP}, acc,"),
    (
        "from r3trace.kernels.mla_decode.cluster_merge import (",
        "from mla_cluster_merge_timeline import (\n    cluster_merge_store_t,",
    ),
]
# the cluster merge's steps: a copy of cluster_merge.cluster_merge_store with stamps, called by the cut kernel
MERGE_STAMPS = [  # (slot, text it goes before)
    (13, "    R: gl.constexpr = KV_LORA // CLUSTER"),  # entry: the row sums summed
    (9, "    _st_cluster(dst, owner, acc)"),  # past barrier 1
    (10, "    _cluster_sync()  # step 3"),  # pushes issued
    (11, "    h_o = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, MERGE_LAYOUT))"),  # past barrier 2
    (14, "    out = (o / den[:, None])"),  # merged, not normalised
    (12, "    gl.store(ptr, out, mask=(h < H)[:, None])"),  # normalised, converted
]
MERGE_STORE = "".join(f"    gl.store(tp + {slot}, _s{slot})\n" for slot, _ in MERGE_STAMPS)
# per-CTA durations reported, ns between two slots: (name, from, to)
STEPS = [("l_sum", 2, 13), ("barrier_1", 13, 9), ("push", 9, 10), ("barrier_2", 10, 11), ("merge", 11, 14),
         ("normalise", 14, 12), ("store", 12, 3)]  # fmt: skip


def _cut(src: str, cuts: list[tuple[str, str]]) -> str:
    for old, new in cuts:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    return src


def timed_module(out_dir: Path) -> object:
    import r3trace.kernels.mla_decode.cluster_merge as cm

    msrc = Path(cm.__file__).read_text()
    first, last = "@gluon.jit\ndef cluster_merge_store(", "@gluon.jit\ndef cluster_merge_nothing("
    body = msrc[msrc.index(first) : msrc.index(last)].replace(
        "def cluster_merge_store(\n", "def cluster_merge_store_t(\n    tp,\n"
    )
    body = _cut(body, [(text, f"    _s{slot} = _now()\n" + text) for slot, text in MERGE_STAMPS])
    body = body.rstrip("\n") + "\n" + MERGE_STORE
    mpath = out_dir / "mla_cluster_merge_timeline.py"
    mpath.write_text(msrc + "\n\n" + body + CLOCKS)
    sys.modules["mla_cluster_merge_timeline"] = load_path(mpath, "mla_cluster_merge_timeline")
    src = _cut(Path(mn.__file__).read_text(), CUTS)
    path = out_dir / "mla_decode_narrow_timeline.py"
    path.write_text(src + CLOCKS)
    return load_path(path, "mla_decode_narrow_timeline")


def summary(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def cell(mod: object, B: int, L: int, calls: int, rep: int) -> dict[str, object]:
    tile = default_decode_tile(16, torch.bfloat16, use_gluon=True, page_size=64)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = tile.num_kv_splits(B, 16, L, sms)
    assert splits in (2, 4, 8) and splits <= tile.cluster, f"B={B} L={L}: {splits} splits, not the cluster form"
    q, kv, r2t, rows, lens = floor.inputs(B, L, 16)
    kvs = [kv] + [torch.randn_like(kv) for _ in range(max(1, floor.copies_for(B * L * floor.ROW_BYTES)) - 1)]
    outs = [torch.empty(B, 16, KV_LORA, dtype=q.dtype, device="cuda") for _ in range(calls)]
    times = [torch.zeros(B * splits, SLOTS, dtype=torch.int64, device="cuda") for _ in range(calls)]
    args = (KV_LORA, 576**-0.5 * LOG2E, tile)  # as mla_decode passes them

    def call(i: int) -> None:
        launched = mod.mla_decode_stage1_narrow(  # type: ignore[attr-defined]
            q, kvs[i % len(kvs)], r2t, rows, lens, outs[i].unsqueeze(2), times[i], *args, pdl=tile.pdl, cluster=splits
        )
        assert launched, "the clusters did not fit"

    ref = mla_decode(q, kvs[0], r2t, rows, lens, KV_LORA, 576**-0.5, splits, tile)
    call(0)
    torch.cuda.synchronize()
    err = float((outs[0].float() - ref.float()).norm() / ref.float().norm())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            call(i)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    per = [t.cpu().tolist() for t in times]
    res: dict[str, object] = {"B": B, "L": L, "splits": splits, "ctas": B * splits, "err_vs_mla_decode": err}
    rows_out = []
    for i in range(1, calls - 1):
        ctas, prev = per[i], per[i - 1]
        g0, g1, g2, g3 = ([c[k] for c in ctas] for k in range(4))
        loop_cyc = [c[6] - c[5] for c in ctas]
        tail_cyc = [c[7] - c[6] for c in ctas]
        head_cyc = [c[5] - c[4] for c in ctas]
        t_end_prev = max(c[3] for c in prev)
        rows_out.append(
            {
                "span_us": (max(g3) - min(g0)) / 1e3,
                "first_t1_after_prev_end_us": (min(g1) - t_end_prev) / 1e3,
                "last_t1_after_prev_end_us": (max(g1) - t_end_prev) / 1e3,
                "end_after_first_t1_us": (max(g3) - min(g1)) / 1e3,
                "t1_spread_us": (max(g1) - min(g1)) / 1e3,
                "t2_spread_us": (max(g2) - min(g2)) / 1e3,
                "t3_spread_us": (max(g3) - min(g3)) / 1e3,
                "head_kcycles": summary([x / 1e3 for x in head_cyc]),
                "loop_kcycles": summary([x / 1e3 for x in loop_cyc]),
                "tail_kcycles": summary([x / 1e3 for x in tail_cyc]),
                "loop_us": summary([(c[2] - c[1]) / 1e3 for c in ctas]),
                "tail_us": summary([(c[3] - c[2]) / 1e3 for c in ctas]),
                "distinct_sms": len({c[8] for c in ctas}),
                **{f"{name}_ns": summary([c[j] - c[i] for c in ctas if c[i] and c[j]]) for name, i, j in STEPS},
            }
        )
    res["calls"] = rows_out
    fns = [partial(call, i) for i in range(len(kvs))]
    plain = [partial(mla_decode, q, c, r2t, rows, lens, KV_LORA, 576**-0.5, splits, tile) for c in kvs]
    res["graph_ms_cut"] = floor.graph_ms(fns, rep)
    res["graph_ms_plain"] = floor.graph_ms(plain, rep)
    # one replay of the graph per timing, its launch not amortised as graph_ms's are
    res["graph_ms_cut_per_call"] = float(do_bench(g.replay, rep=rep, return_mode="median")) / calls
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="64x1024,64x8192", help="BxL,... (cluster-merged cells)")
    ap.add_argument("--calls", type=int, default=8, help="calls back to back in the graph")
    ap.add_argument("--rep", type=int, default=20, help="ms of replays per retry (do_bench_cudagraph)")
    a = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    mod = timed_module(out_dir)
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "cells": []}
    for c in a.cells.split(","):
        B, L = (int(x) for x in c.split("x"))
        row = cell(mod, B, L, a.calls, a.rep)
        res["cells"].append(row)  # type: ignore[attr-defined]
        print(json.dumps(row, indent=1), flush=True)
        (out_dir / "mla16_timeline.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
