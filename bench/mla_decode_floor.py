"""MLA decode at H = 16 against what the H200 allows at each cell's byte count (issue 6 point 8).

Run (GPU): python bench/mla_decode_floor.py [--sweep] [--cells 16x1024,64x8192] [--rep 20]  -> $OUT/mla16_floor.json

Per cell (B, L; bytes = B L 1152, the latent cache read once), all timed the same way: CUDA-graph replays of
back-to-back calls (triton's do_bench_cudagraph, graph launch amortised: what a kernel costs inside the
engine's decode graph), inputs under 4 x the 60 MB L2 rotated among copies so every call reads HBM:
  read    a Triton kernel streaming the same bytes (contiguous, grid-stride, best of 4 grid sizes)
  copy    torch's device copy of the same bytes (read + write)
  decode  --sweep: the default then in place (OLD) and candidates: split counts and a few tiles at the small
          cells. Without --sweep: OLD and the current default alternately, twice each (drift shows as a gap
          between the pairs), and a few tiles at the small cells. Session 4's runs 1-3 also timed a merge
          "last" variant (no stage-2 launch: the last split program of a request merged it); it lost wherever
          a request had >= 8 splits and was removed (commit 54b98eb has it and this script's use of it)
--parts (session 5): stage 1 alone, whole and with one part cut from its source (PARTS), stage 2 alone, the
same call on contiguous slots (cells < 200 MB), and launch options (OPTIONS or --options) each paired with
the default timed just before it (--pairs alternations).
Once per run: the graph floor (one and two tiny kernels per call, and one graph replay of one kernel),
and the 1 GiB copy ceiling as bench/kernels.py measures it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from sibling import load_path, load_sibling  # bench/sibling.py: python bench/<script>.py puts bench/ on the path
from triton.testing import do_bench, do_bench_cudagraph

from r3trace.kernels.flash import LOG2E
from r3trace.kernels.mla_decode import DecodeTile, default_decode_tile, mla_decode, mla_decode_ref

KV_LORA, ROPE = 512, 64
ROW_BYTES = (KV_LORA + ROPE) * 2
L2_BYTES = 60 * 2**20
COPY_GBS = 4220.0  # the goal's copy bandwidth (BENCHMARKS.md: 4222-4245 GB/s measured in sessions 3-4)
CELLS = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)]
# split counts tried per (B, L), besides the default's: fewer and more programs per SM (bench/NOTES.md)
SPLITS = {16: {1024: [4, 8, 16, 32], 8192: [8, 16, 32], 32768: [16, 33]}, 64: {1024: [2, 4], 8192: [4, 8],
          32768: [4, 8]}, 256: {1024: [1, 2], 8192: [1, 2], 32768: [1, 2]}}  # fmt: skip
# tiles tried at the cells under 600 MB: 16-key tiles fit 3 programs per SM at 4 stages
# (4 x 18 KB), 64-key tiles one (2 x 74 KB); the default 16 x 32 x 3 stages fits two
SMALL_TILES = [DecodeTile(16, 16, 4, 4), DecodeTile(16, 64, 4, 2), DecodeTile(16, 32, 8, 3)]
OLD = DecodeTile(16, 32, 4, 3, waves=4, whole_waves=True)  # the H < 64 bf16 default before session 4 (cdd240e)
# tiles tried at the small cells without --sweep: 16-key tiles (164 registers, 3 programs per
# SM), value columns in two programs (155 registers, both halves score all 576 columns), 64-key tiles
FINAL_TILES = [DecodeTile(16, 16, 4, 4), DecodeTile(16, 32, 4, 3, v_splits=2), DecodeTile(16, 64, 4, 2)]
inputs = load_sibling("kernels.py", "bench_kernels")._decode_inputs  # shuffled 64-slot pages, all length L


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Stream x [n] int32 once, grid-stride in BLOCK-element chunks; one sum per program keeps the loads."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    # int64: the 32k x 256 cache is 2.4e9 int32 elements
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
        acc += tl.load(x_ptr + start + offs, mask=start + offs < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _tiny_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1)


def graph_ms(fns: Sequence[Callable[[], object]], rep: int) -> float:
    """Median ms per call of CUDA-graph replays that call fns in turn (one graph, calls back to back)."""
    torch.cuda.synchronize()  # do_bench_cudagraph's side stream does not wait for the default one

    def each() -> None:
        for fn in fns:
            fn()

    return float(do_bench_cudagraph(each, rep=rep, return_mode="median")) / len(fns)


def copies_for(nbytes: int) -> int:
    """Rotated copies so the set spans >= 4 x L2 (capped at 8, as bench/kernels.py)."""
    return max(1, min(8, math.ceil(4 * L2_BYTES / nbytes)))


def read_ms(bufs: list[torch.Tensor], sms: int, rep: int, grids: Sequence[int]) -> dict[str, float]:
    """The streaming read at `grids` programs per SM (4 warps, 16 KB a load)."""
    res = {}
    for per_sm in grids:
        out = torch.empty(sms * per_sm, dtype=torch.int32, device="cuda")
        flat = [b.view(torch.int32).view(-1) for b in bufs]
        fns = [partial(_read_kernel[(sms * per_sm,)], x, out, x.numel(), BLOCK=4096, num_warps=4) for x in flat]
        res[f"read_{per_sm}_per_sm"] = graph_ms(fns, rep)
    return res


def floors(rep: int) -> dict[str, float]:
    out = torch.zeros(4, dtype=torch.int32, device="cuda")
    one = partial(_tiny_kernel[(1,)], out)
    res = {"graph_1_kernel": graph_ms([one], rep), "graph_2_kernels": graph_ms([one, one], rep) * 2}
    g = torch.cuda.CUDAGraph()
    one()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        one()
    res["replay_1_graph"] = float(do_bench(g.replay, warmup=25, rep=rep, return_mode="median"))
    src = torch.randn(2**28, device="cuda")  # 1 GiB fp32, bench/kernels.py's ceiling
    dst = torch.empty_like(src)
    res["copy_1GiB_GBps"] = 2 * src.numel() * 4 / float(do_bench(partial(dst.copy_, src), rep=100)) / 1e6
    return res


def check(tile: DecodeTile) -> float:
    """Normwise error vs the fp32 reference: mixed odd lengths, 7 splits, the tile's page size (1: every slot
    shuffled; 64k: shuffled pages of that many slots)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    lens = [1, 700, 3001, 64, 1500, 33, 2049, 5, 999]
    page = tile.page_size
    npages = sum(-(-n // page) for n in lens) + 2
    perm = torch.randperm(npages, device="cuda", generator=g)
    r2t = torch.zeros(len(lens), 3008 + page, dtype=torch.int32, device="cuda")
    off = 0
    for b, n in enumerate(lens):
        k = -(-n // page)
        slots = (perm[off : off + k, None] * page + torch.arange(page, device="cuda")).reshape(-1)
        r2t[b, : k * page] = slots.to(torch.int32)
        off += k
    perm = torch.arange(npages * page, device="cuda")  # the cache's row count
    q = torch.randn(len(lens), 16, KV_LORA + ROPE, device="cuda", generator=g).bfloat16()
    kv = torch.randn(perm.numel(), KV_LORA + ROPE, device="cuda", generator=g).bfloat16()
    rows, seq = torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda")
    out = mla_decode(q, kv, r2t, rows, seq, KV_LORA, 576**-0.5, num_kv_splits=7, tile=tile).float()
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq, KV_LORA, 576**-0.5).float()
    return ((out - ref).norm() / ref.norm()).item()


def cell(B: int, L: int, sms: int, rep: int, base: DecodeTile, sweep: bool, pairs: int = 2) -> dict[str, object]:
    nbytes = B * L * ROW_BYTES
    q, kv, r2t, rows, lens = inputs(B, L, 16)
    n = copies_for(nbytes)
    kvs = [kv] + [torch.randn_like(kv) for _ in range(n - 1)]
    row: dict[str, object] = {"B": B, "L": L, "MB": nbytes / 1e6, "copies": n}
    # run 1: 16 programs per SM best or within 0.5% of 8 at every cell; 2 and 4 1.2-1.9x slower
    t: dict[str, float] = read_ms(kvs, sms, rep, (2, 4, 8, 16) if sweep else (8, 16))
    row["read_ms"] = min(t.values())
    if sweep:
        dsts = [torch.empty_like(k) for k in kvs]
        t["copy"] = graph_ms([partial(d.copy_, k) for d, k in zip(dsts, kvs, strict=True)], rep)
        del dsts

    def decode(tile: DecodeTile, splits: int, rotate: bool = True) -> float:
        caches = kvs if rotate else kvs[:1]
        return graph_ms([partial(mla_decode, q, c, r2t, rows, lens, KV_LORA, 576**-0.5, splits, tile) for c in caches],
                        rep)  # fmt: skip

    auto = base.num_kv_splits(B, 16, L, sms)
    row["default_splits"] = auto
    if not sweep:
        old = OLD.num_kv_splits(B, 16, L, sms)
        row["old_splits"] = old
        for i in range(1, pairs + 1):  # alternately: run 2 saw the pairs drift 1-10% slower within a cell
            t[f"old/{old}/#{i}"] = decode(OLD, old)
            t[f"new/{auto}/#{i}"] = decode(base, auto)
            if auto == 1:  # the same split written out by stage 1 (direct; session 4: 2% slower at B256/1k)
                t[f"direct/{auto}/#{i}"] = decode(base._replace(direct=True), auto)
        if nbytes < 600e6 and pairs <= 2:
            for tile in FINAL_TILES:
                t[f"launch/{auto}/{'x'.join(str(x) for x in tile[:4])}/v{tile.v_splits}"] = decode(tile, auto)
        return _report(row, t, nbytes)
    t[f"default/{auto}"] = decode(base, auto)
    if nbytes < 4 * L2_BYTES:  # as session 3's table timed it: one cache, L2-warm at 19 MB
        t[f"default/{auto}/no-rotation"] = decode(base, auto, rotate=False)
    for s in sorted(set(SPLITS[B][L]) - {auto}):
        t[f"launch/{s}"] = decode(base, s)
    if nbytes < 600e6:
        best = min((k for k in t if k.startswith(("launch/", "default/"))), key=lambda k: t[k])
        s = int(best.split("/")[1])
        for tile in SMALL_TILES:
            t[f"launch/{s}/{tile.block_h}x{tile.block_n}x{tile.num_warps}w{tile.num_stages}st"] = decode(tile, s)
    return _report(row, t, nbytes)


def _report(row: dict[str, object], t: dict[str, float], nbytes: int) -> dict[str, object]:
    row["ms"] = t
    B, L, read = row["B"], row["L"], float(row["read_ms"])  # type: ignore[arg-type]
    for k, v in t.items():
        if not k.startswith("read_"):
            print(f"B={B} L={L} {k}: {v:.4f} ms {nbytes / v / 1e6:.0f} GB/s {100 * nbytes / v / 1e6 / COPY_GBS:.0f}% "
                  f"of {COPY_GBS:.0f}, {100 * read / v:.0f}% of read", flush=True)  # fmt: skip
    print(f"B={B} L={L} read floor {read:.4f} ms ({nbytes / read / 1e6:.0f} GB/s) "
          + " ".join(f"{k}:{v:.4f}" for k, v in t.items() if k.startswith("read_")), flush=True)  # fmt: skip
    return row


# Session 5 (--parts): the Triton stage 1 with one part cut out of its source (kernels/mla_decode_triton.py; the
# results are wrong, only the times count), each timed alone as graph replays beside the whole stage 1, to see where
# the time above the read floor goes. (name, text, replacement); the text must occur exactly once.
SOFTMAX = "            m_i, l_i, acc = online_softmax_step(s, kv, m_i, l_i, acc, UPCAST, INPUT_PRECISION)\n"
PARTS = [
    # P V, the exponentials and the rescale cut: the gather, the score dots and the row max stay
    ("no_pv_exp", SOFTMAX, "            m_i = tl.maximum(m_i, tl.max(s, axis=1))\n"),
    # the softmax cut (max, exp, rescale), both dots stay: P = S
    ("no_softmax", SOFTMAX, "            acc += tl.dot(s.to(kv.dtype), kv)\n            l_i += tl.sum(s, axis=1)\n"),
    # the partial store masked off (the value test keeps the loop's work live)
    (
        "no_write",
        "mask=h_mask[:, None] & v_mask[None, :])  # fp32",
        "mask=h_mask[:, None] & v_mask[None, :] & (out == 1234.5))  # fp32",
    ),
    ("no_loop", "    for n0 in range(start, end, BLOCK_N):", "    for n0 in range(start, start, BLOCK_N):"),
    # every program returns after loading its length and request row: the launch and one load
    ("launch", "    if start >= end:  # short request", "    if start >= 0:  # short request"),
]
# the launch options timed against the default, alternately (DecodeTile fields); --options replaces them.
# Session 5 (bench/NOTES.md "mla16b, session 5"), each slower than the default and removed after its run:
# partials in bf16 (B64/1k +5%; with pdl +7-8 us everywhere), an L2 prefetch of kv rows 1-3 tiles ahead (a bulk
# request a row, or a line at a time: 1.3-2.2x), 16-key tiles at 5-6 stages (1.25-1.36x), slots loaded two
# tiles ahead (the gather stopped being cp.async: 1.5-1.7x), req_to_token prefetched to L2 (a tie) or
# loaded evict_last (+2-4%). pdl is the default since run 4.
# Session 6 run 6: three programs an SM (a register cap of 168 through triton's maxnreg, 2 stages, 24 splits at
# B16/8k) 0.0585 ms vs 0.0497 for the default; 2 stages alone 0.077 (bench/NOTES.md "Engine owner, session 6").
OPTIONS: dict[str, dict[str, object]] = {"nopdl": {"pdl": False}}


def parse_options(text: str) -> dict[str, dict[str, object]]:
    """'sa2=slots_ahead:2,x=pdl:0+slot_policy:evict_last' -> {"sa2": {"slots_ahead": 2}, ...} (digits as ints)."""
    out: dict[str, dict[str, object]] = {}
    for item in text.split(","):
        name, fields = item.split("=")
        out[name] = {k: int(v) if v.isdigit() else v for k, v in (f.split(":") for f in fields.split("+"))}
    return out


def cut_modules(out_dir: Path) -> dict[str, object]:
    """kernels/mla_decode_triton.py (the Triton stage 1) with each PARTS cut, loaded as modules (their own JIT cache
    entries)."""
    import r3trace.kernels.mla_decode.triton_stage1 as mt

    src = Path(mt.__file__).read_text()
    mods: dict[str, object] = {"whole": mt}
    for name, old, new in PARTS:
        assert src.count(old) == 1, name
        path = out_dir / f"mla_decode_triton_{name}.py"
        path.write_text(src.replace(old, new))
        mods[name] = load_path(path, f"mla_decode_triton_{name}")
    return mods


def option_tile(base: DecodeTile, option: dict[str, object]) -> DecodeTile:
    """The tile an option names: its DecodeTile fields (not "splits", not the narrow kernel's flag_ keys)."""
    return base._replace(**{f: x for f, x in option.items() if f != "splits" and not f.startswith("flag_")})


def narrow_flags(option: dict[str, object]) -> dict[str, bool]:
    """flag_EARLY_REFILL:1 -> {"EARLY_REFILL": True}: mla_decode_narrow's constexpr switches."""
    return {f[5:]: bool(x) for f, x in option.items() if f.startswith("flag_")}


def call_with_flags(flags: dict[str, bool], *args: object) -> torch.Tensor:
    """mla_decode(*args); the narrow kernel has no constexpr switches left to flip (its form follows the tile's
    page_size), so flag_ options are refused."""
    if flags:
        raise SystemExit(f"the narrow kernel has no switches {sorted(flags)}: set DecodeTile fields instead")
    return mla_decode(*args)  # type: ignore[arg-type]


def parts_cell(
    B: int,
    L: int,
    sms: int,
    rep: int,
    base: DecodeTile,
    mods: dict[str, object],
    options: dict[str, dict[str, object]],
    pairs: int = 2,
) -> dict[str, object]:
    """Stage 1 whole and cut, stage 2 alone, and OPTIONS against the default (two pairs) at one cell."""
    nbytes = B * L * ROW_BYTES
    q, kv, r2t, rows, lens = inputs(B, L, 16)
    kvs = [kv] + [torch.randn_like(kv) for _ in range(copies_for(nbytes) - 1)]
    splits = base.num_kv_splits(B, 16, L, sms)
    row: dict[str, object] = {"B": B, "L": L, "MB": nbytes / 1e6, "splits": splits}
    t: dict[str, float] = read_ms(kvs, sms, rep, (8, 16))
    row["read_ms"] = min(t.values())
    part = torch.empty(B, 16, splits, KV_LORA, device="cuda")
    lse = torch.empty(B, 16, splits, device="cuda")
    for name, mod in mods.items():
        fns = [partial(mod.mla_decode_stage1_triton, q, c, r2t, rows, lens, part, lse, KV_LORA, 576**-0.5 * LOG2E,
                       base) for c in kvs]  # type: ignore[attr-defined]  # fmt: skip
        t[f"stage1/{name}"] = graph_ms(fns, rep)
    if mods:
        sw = load_sibling("mla_decode_sweep.py", "mla_decode_sweep")
        t["stage2"] = sw.merge_ms(B, 16, splits, L, lambda fn: graph_ms([fn], rep))
    # an option may set "splits" too (the split count is not a tile field): {name: (tile, splits)}
    # (an option's own tile picks its count otherwise: the narrow kernel's one program an SM)
    calls = {k: (tile := option_tile(base, v), int(v.get("splits", tile.num_kv_splits(B, 16, L, sms))))  # type: ignore[call-overload]
             for k, v in options.items()}
    if nbytes < 200e6:  # how much the shuffled pages cost: the same call on requests laid out contiguously
        flat = torch.arange(B * L, device="cuda", dtype=r2t.dtype).view(B, L)
        for name, table in (("default", r2t), ("contiguous", flat)):
            t[f"{name}/slots"] = graph_ms(
                [partial(mla_decode, q, c, table, rows, lens, KV_LORA, 576**-0.5, splits, base) for c in kvs], rep
            )
    for i in range(1, pairs + 1):
        for k, (tile, n_split) in calls.items():
            for name, tl_, ns in (("default", base, splits), (k, tile, n_split)):
                flags = narrow_flags(options[k]) if name == k else {}
                t[f"{name}/#{i}/{k}" if name == "default" else f"{name}/#{i}"] = graph_ms(
                    [partial(call_with_flags, flags, q, c, r2t, rows, lens, KV_LORA, 576**-0.5, ns, tl_) for c in kvs],
                    rep,
                )
    return _report(row, t, nbytes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="", help="BxL,... (default: the nine issue-6 cells)")
    ap.add_argument("--rep", type=int, default=20, help="ms of replays per retry (do_bench_cudagraph)")
    ap.add_argument("--sweep", action="store_true", help="run 1's split sweep (OLD as the default)")
    ap.add_argument("--pairs", type=int, default=2, help="old/new pairs per cell")
    ap.add_argument("--no-floors", action="store_true", help="skip the error checks and graph floors")
    ap.add_argument("--parts", action="store_true", help="stage 1 with parts cut, stage 2 alone, OPTIONS")
    ap.add_argument("--options", default="", help="with --parts: these options instead (parse_options)")
    ap.add_argument("--no-cuts", action="store_true", help="with --parts: only the options, no cuts")
    ap.add_argument("--gluon", action="store_true", help="the default tile as the engine picks it on Hopper")
    a = ap.parse_args()
    cells = [tuple(int(x) for x in c.split("x")) for c in a.cells.split(",")] if a.cells else CELLS
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # the Triton tile (the engine's off Hopper, and the baseline the narrow Gluon tile is timed against), or
    # --gluon: the engine's Hopper default for these 64-slot pages (the narrow Gluon tile, TMA form)
    base = OLD if a.sweep else default_decode_tile(16, torch.bfloat16, use_gluon=a.gluon, page_size=64)
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "base_tile": list(base)}
    tiles = [base, *(SMALL_TILES if a.sweep else [OLD, *FINAL_TILES])]
    options = parse_options(a.options) if a.options else OPTIONS
    if a.parts:
        tiles = [base, *(option_tile(base, v) for v in options.values())]
    if not a.no_floors:
        res["errors"] = {str(tuple(t)): check(t) for t in tiles}
        res["floors"] = floors(a.rep)
    print(json.dumps(res), flush=True)
    rows = []
    mods = cut_modules(out_dir) if a.parts and not a.no_cuts else {}
    for B, L in cells:
        if a.parts:
            rows.append(parts_cell(B, L, sms, a.rep, base, mods, options, a.pairs))
        else:
            rows.append(cell(B, L, sms, a.rep, base, a.sweep, a.pairs))
        res["cells"] = rows
        (out_dir / "mla16_floor.json").write_text(json.dumps(res, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
