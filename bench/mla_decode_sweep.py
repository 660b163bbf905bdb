"""MLA decode stage-1 tile sweep on one GPU, sync-free (splits from host lengths, as the engine passes them).

Run (GPU): python bench/mla_decode_sweep.py [--quick]   -> table on stdout, JSON in $OUT/mla_decode_sweep.json

Every tile is first checked against the fp32 torch reference on a mixed-length batch (page size 1, odd
lengths), then timed with triton.testing.do_bench (median) at a few (H, B, L) shapes. FLOPs = 2 B H L
(576 + 512), bytes = the latent cache once (B L 1152). The cache at these shapes (>= 600 MB) is 10x the
60 MB L2, so no rotation is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from sibling import load_path, load_sibling  # bench/sibling.py: python bench/<script>.py puts bench/ on the path
from triton.testing import do_bench, do_bench_cudagraph

from r3trace.kernels.mla_decode import (
    DecodeTile,
    choose_num_kv_splits,
    default_decode_tile,
    mla_decode,
    mla_decode_ref,
)

KV_LORA, ROPE, PAGE = 512, 64, 64

# H = 128 candidates. 64-head tiles at 8 warps compute the scores twice (Triton puts both warpgroups on
# the 64 rows of a chained product); v_splits 2 at 4 warps computes them once per value half. Stages >= 3
# issue the gather two tiles ahead (EARLY_SLOTS); at 2 the copy is awaited right after it is issued.
D = DecodeTile
# Run 1 (bench/NOTES.md) timed 64x64x8w,2st; 64x32x8w at 3-4 stages; 64x32x4w v_splits 2 at 3-4 stages;
# 64x64x4w v_splits 2; 32x32x4w,3st; 16x64x4w; keys-major 64x128x8w,1st: none beat 64x64x8w,2st. With one
# program per SM every warp waits out its own latencies, so run 2 adds tiles that fit two programs per SM
# (<= 113 KB shared memory, <= 255 registers at 4 warps) and 128-head tiles (no score recompute inside).
TILES_128 = [
    D(64, 64, 8, 2), D(128, 32, 8, 2, 2), D(128, 16, 8, 3, 2), D(64, 16, 4, 2, 2), D(32, 16, 4, 3),
    D(32, 16, 4, 4), D(64, 32, 4, 4, 2),
]  # fmt: skip
TILES_16 = [D(16, 64, 4, 2), D(16, 32, 4, 3)]
SHAPES = {128: [(64, 8192), (256, 8192), (16, 32768), (256, 32768)], 16: [(64, 8192), (16, 32768), (256, 32768)]}


GRAPH = False  # --graph: time CUDA-graph replays (as the engine decodes), not eager calls


def ms(fn: partial[torch.Tensor]) -> float:
    """Median ms. Eager calls carry ~0.17 ms of host launch cost (argument checks, two Triton launches):
    session 3 run 1 timed B = 16 / 8k (151 MB) at 0.177 ms whatever the split count, so eager times of
    the small H = 16 cells are a host floor, not the kernel; graph replays remove it."""
    if GRAPH:
        # do_bench_cudagraph runs fn on a side stream that does not wait for the default stream: without
        # this sync it read req_to_token before randperm had written it (illegal address, session 3 run 2)
        torch.cuda.synchronize()
        return float(do_bench_cudagraph(fn, rep=60, return_mode="median"))
    return float(do_bench(fn, warmup=25, rep=60, return_mode="median"))


# the table's inputs: shuffled 64-slot pages, every request L long
inputs = load_sibling("kernels.py", "bench_kernels")._decode_inputs


def check(tile: DecodeTile, H: int) -> float:
    """Normwise error vs the fp32 reference: 9 requests of mixed odd lengths, page size 1, splits 7."""
    g = torch.Generator(device="cuda").manual_seed(tile.block_h * 7 + tile.block_n + H)
    lens = [1, 700, 3001, 64, 1500, 33, 2049, 5, 999]
    S = sum(lens) + 100
    perm = torch.randperm(S, device="cuda", generator=g)
    # width 3008: a multiple of 16 like the timed tables' (else Triton specialises the stride apart: a 2nd compile)
    r2t = torch.zeros(len(lens), 3008, dtype=torch.int32, device="cuda")
    off = 0
    for b, n in enumerate(lens):
        r2t[b, :n] = perm[off : off + n]
        off += n
    q = torch.randn(len(lens), H, KV_LORA + ROPE, device="cuda", generator=g).bfloat16()
    kv = torch.randn(S, KV_LORA + ROPE, device="cuda", generator=g).bfloat16()
    rows = torch.arange(len(lens), device="cuda")
    seq = torch.tensor(lens, device="cuda")
    out = mla_decode(q, kv, r2t, rows, seq, KV_LORA, 576**-0.5, num_kv_splits=7, tile=tile).float()
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq, KV_LORA, 576**-0.5).float()
    return ((out - ref).norm() / ref.norm()).item()


def load_old(path: str) -> ModuleType:
    """A previous mla_decode.py (e.g. `git show REV:kernels/mla_decode.py`), timed in the same run."""
    return load_path(path, "old_mla_decode")


# H = 16 split-count sweep (session 3): the memory-bound cells below 75% of copy run 8-16 programs per SM,
# one at a time (a 64-key tile double-buffered is 144 KB): each program's q load, first-tile latency and
# partial write are not overlapped by another program, and the last wave is partly empty (B = 64 / 8k:
# 1088 programs = 8.24 waves of 132). Candidates: splits that fill whole waves, and 32-key tiles (72 KB at
# 2 stages: 2-3 programs per SM, so one program's prologue/epilogue hides under another's loop).
# Run 1 (eager): 16x64x4w,2st and 16x32x4w,3st best; 8 warps, 16x32 at 2 stages, 16x64 at 3 stages 5-50% slower.
# Run 3: graph-timed, splits cut to whole tiles: 16x32x4w,3st at 8 splits best at B = 64 / 8k. Run 4: all
# nine H = 16 cells, the launcher's split count at 8 waves and at 4 (the tile's `waves`) among the candidates.
TILES_16_SPLITS = [D(16, 64, 4, 2), D(16, 32, 4, 3)]
SHAPES_16_SPLITS = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)]
SPLITS_16 = {64: [8, 12, 16], 16: [16, 32], 256: [1, 2, 3]}


def merge_ms(
    B: int, H: int, splits: int, seq_len: int = 1 << 20, timer: Callable[[Callable[[], None]], float] | None = None
) -> float:
    """Stage 2 alone on [B, H, splits, 512] fp32 partials: the merge's share of a decode call. Requests of
    seq_len keys (the default keeps every split live); timed eagerly unless a timer is given (bench/
    mla_decode_h128.py passes `ms` with GRAPH on)."""
    from r3trace.kernels.mla_decode.merge import _mla_decode_merge_kernel

    part = torch.randn(B, H, splits, KV_LORA, device="cuda")
    lse = torch.randn(B, H, splits, device="cuda")
    lens = torch.full((B,), seq_len, device="cuda", dtype=torch.int64)
    out = torch.empty(B, H, KV_LORA, device="cuda", dtype=torch.bfloat16)

    def run() -> None:
        _mla_decode_merge_kernel[(B, H)](
            part, lse, lens, out, KV_LORA, splits, 64, part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            BLOCK_P=max(2, 1 << (splits - 1).bit_length()), BLOCK_C=KV_LORA, PDL=False, num_warps=4,
        )  # fmt: skip

    if timer is not None:
        return float(timer(run))
    return float(do_bench(run, warmup=25, rep=60, return_mode="median"))


def sweep_h16_splits(out_dir: Path, sms: int, old: ModuleType | None) -> None:
    """Every (tile, splits) at the H = 16 shapes; the launcher default (tile and choose_num_kv_splits)
    is among them, so each cell's gain is against the default in the same run; --old: a previous
    mla_decode.py at its own default too."""
    res: list[dict[str, object]] = []
    errs = {tuple(t): check(t, 16) for t in TILES_16_SPLITS}
    print("H=16 errors:", {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
    for B, L in SHAPES_16_SPLITS:
        q, kv, r2t, rows, lens = inputs(B, L, 16)
        auto = choose_num_kv_splits(B, 1, L, sms)
        auto4 = choose_num_kv_splits(B, 1, L, sms, waves=4)
        cands = sorted({auto, auto4, *(n for n in SPLITS_16.get(B, []) if n <= choose_num_kv_splits(1, 1, L, 10**6))})
        gb = B * L * (KV_LORA + ROPE) * 2 / 1e6
        for tile in TILES_16_SPLITS:
            times = {n: ms(partial(mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, n, tile)) for n in cands}
            best = min(times, key=lambda n: times[n])
            res.append({"B": B, "L": L, "tile": list(tile), "auto": auto, "auto4": auto4, "ms": times,
                        "err": errs[tuple(tile)]})  # fmt: skip
            print(f"H=16 B={B} L={L} tile {tuple(tile)} auto {auto}: {times[auto]:.4f} ms ({gb / times[auto]:.0f} GB/s)"
                  f" 4-wave auto {auto4}: {times[auto4]:.4f} ms ({gb / times[auto4]:.0f} GB/s)"
                  f" best {best}: {times[best]:.4f} ms ({gb / times[best]:.0f} GB/s) | "
                  + " ".join(f"{n}:{t:.4f}" for n, t in times.items()), flush=True)  # fmt: skip
            (out_dir / "mla_decode_h16_splits.json").write_text(json.dumps(res, indent=1))
        if old is not None:
            n = old.choose_num_kv_splits(B, 1, L, sms)
            t = ms(partial(old.mla_decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, n))
            res.append({"B": B, "L": L, "tile": "old default", "auto": n, "ms": {n: t}})
            print(f"H=16 B={B} L={L} old kernel, its default, {n} splits: {t:.4f} ms ({gb / t:.0f} GB/s)", flush=True)
        print(f"  merge alone at {auto} splits: {merge_ms(B, 16, auto):.4f} ms", flush=True)
        del q, kv


def table(out_dir: Path, sms: int, old: ModuleType) -> None:
    """The 18 cells of issue 6 point 8: the defaults the engine gets on this GPU (default_decode_tile with
    use_gluon, the tile's split count) against `old`'s defaults, each timed eagerly and as graph replays."""
    global GRAPH
    res: list[dict[str, object]] = []
    for H in (16, 128):
        tile = default_decode_tile(H, torch.bfloat16, use_gluon=True)
        err = check(tile, H)
        print(f"H={H} default {tuple(tile)} err {err:.1e}", flush=True)
        for B in (16, 64, 256):
            for L in (1024, 8192, 32768):
                q, kv, r2t, rows, lens = inputs(B, L, H)
                n_new = tile.num_kv_splits(B, H, L, sms)
                old_bh = old.default_decode_tile(H, q.dtype)[0]
                n_old = old.choose_num_kv_splits(B, -(-H // old_bh), L, sms)
                row: dict[str, object] = {"H": H, "B": B, "L": L, "tile": list(tile), "err": err,
                                          "splits_new": n_new, "splits_old": n_old}  # fmt: skip
                for GRAPH in (False, True):
                    mode = "graph" if GRAPH else "eager"
                    args = (q, kv, r2t, rows, lens, KV_LORA, 576**-0.5)
                    row[f"new_{mode}"] = ms(partial(mla_decode, *args, n_new, tile))
                    row[f"old_{mode}"] = ms(partial(old.mla_decode, *args, n_old))
                res.append(row)
                print(" ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                               if k not in ("tile", "err")), flush=True)  # fmt: skip
                (out_dir / "mla_decode_table.json").write_text(json.dumps(res, indent=1))
                del q, kv
                torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--h16-splits", action="store_true", help="only the H = 16 (tile, split count) sweep")
    ap.add_argument("--h128-gluon", action="store_true", help="only H = 128: the Gluon stage 1 vs the default")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays")
    ap.add_argument("--table", action="store_true", help="the 18 cells, new defaults vs --old, eager and graph")
    ap.add_argument("--old", help="path of a previous mla_decode.py whose default tile is timed too")
    a = ap.parse_args()
    old = load_old(a.old) if a.old else None
    global GRAPH
    GRAPH = a.graph
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if a.table:
        assert old is not None, "--table times the --old kernel too"
        table(out_dir, sms, old)
        return
    if a.h16_splits:
        sweep_h16_splits(out_dir, sms, old)
        return
    groups: tuple[tuple[int, list[DecodeTile]], ...] = ((128, TILES_128), (16, TILES_16))
    if a.h128_gluon:  # session 3: FlashMLA's two-warpgroup split in Gluon against the Triton default
        groups = ((128, [D(64, 64, 8, 2), D(64, 64, 8, 2, kernel="wide")]),)
    res: list[dict[str, object]] = []
    for H, tiles in groups:
        shapes = SHAPES[H][:1] if a.quick else SHAPES[H]
        runs: list[tuple[str, DecodeTile | None]] = [("new", t) for t in tiles]
        runs += [("old", None)] if old is not None else []
        for kind, tile in runs:
            decode = mla_decode if tile is not None else old.mla_decode  # type: ignore[union-attr]
            row: dict[str, object] = {"H": H, "kernel": kind, "tile": list(tile) if tile else "old default"}
            try:
                if tile is not None:
                    row["rel_err"] = check(tile, H)
                for B, L in shapes:
                    q, kv, r2t, rows, lens = inputs(B, L, H)
                    old_bh = old.default_decode_tile(H, q.dtype)[0] if old is not None else 1
                    programs = tile.head_programs(H) if tile is not None else -(-H // old_bh)
                    splits = choose_num_kv_splits(B, programs, L, sms)
                    t = ms(partial(decode, q, kv, r2t, rows, lens, KV_LORA, 576**-0.5, splits, tile))
                    tflops = 2 * B * H * L * (KV_LORA + ROPE + KV_LORA) / t / 1e9
                    gbs = B * L * (KV_LORA + ROPE) * 2 / t / 1e6
                    row[f"B{B}_L{L}"] = {"splits": splits, "ms": t, "TFLOPs": tflops, "GBps": gbs}
                    del q, kv
            except Exception as e:  # out of shared memory, compile failure: recorded, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                traceback.print_exc(limit=1)
            res.append(row)
            cells = " ".join(
                f"B{k}: {v['ms']:.3f} ms {v['TFLOPs']:.0f} TF {v['GBps']:.0f} GB/s"  # type: ignore[index]
                for k, v in row.items() if k.startswith("B")
            )  # fmt: skip
            err = row.get("rel_err", float("nan"))
            print(f"H={H} {kind} {tuple(tile) if tile else ''} err {err:.1e} {cells} {row.get('error', '')}",
                  flush=True)  # fmt: skip
            (out_dir / "mla_decode_sweep.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
