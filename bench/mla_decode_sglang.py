"""r3trace's MLA decode beside SGLang's Triton MLA decode: the same cells, the same inputs, the same run (issue 6's
MLA cells, H200).

Run (GPU):  python -m bench.mla_decode_sglang --sglang PATH [--heads 16,128] [--cells BxL,...] [--out F]
Smoke (CPU): TRITON_INTERPRET=1 python -m bench.mla_decode_sglang --smoke   (r3trace's side only: SGLang's kernel
            needs its file)

PATH: SGLang's python/sglang/srt/layers/attention/triton_ops/decode_attention.py, fetched beside the project and never
committed (BENCHMARKS.md names the commit measured). Its one SGLang import, sglang.srt.utils.is_hip, gets a stand-in
module answering False (this is a CUDA GPU).

SGLang's call as its Triton attention backend makes it for MLA: k_buffer the latent cache viewed [S, 1, 576], v_buffer
its first 512 columns, kv_indptr / kv_indices the requests' cache slots flattened, fp32 split partials [B, H,
max_splits, 512] and LSEs, every request at the same split count. SGLang picks that count per request from lengths and
the SM count, capped by --triton-attention-num-kv-splits (8 by default); here it is timed at 1, 2, 4, 8 and 16, with
int32 and int64 kv_indices (main() says why), and the fastest taken: the baseline's best case. r3trace: mla_decode with
the engine's Hopper tile on 64-slot pages (default_decode_tile(H, bf16, use_gluon=True, page_size=64)) at its own split
count, and the tile the engine takes at its default page size of 1 (r3trace_page1_ms). All are timed the same way
(bench.timing.Timer.graph_ms: one CUDA graph of back-to-back calls, median; caches rotated over copies spanning >= 4x
the L2 at small cells) on the same shuffled 64-slot pages, and checked against mla_decode_ref first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

from bench.inputs import DecodeInputs, decode_cell, rotated_decode_cell
from bench.mla_decode import add_peer_args, parse_cells, rel_err
from bench.timing import Timer, measure_ceilings
from r3trace.kernels.mla_decode import default_decode_tile, mla_decode, mla_decode_ref

SGLANG_SPLITS = (1, 2, 4, 8, 16)


def load_sglang(path: str) -> types.ModuleType:
    """SGLang's decode_attention.py (a peer's file given on the command line) as a module, its one SGLang import,
    sglang.srt.utils.is_hip, answered by a stand-in."""
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_hip = lambda: False  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["sglang.srt.utils"] = utils
    spec = importlib.util.spec_from_file_location("sglang_decode_attention", Path(path))
    if spec is None or spec.loader is None:
        raise SystemExit(f"--sglang {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SglangCall:
    """decode_attention_fwd on r3trace's inputs (q [B, H, C], the cache [S, C], each request's slots [B, L] in
    request order), all buffers made once so a CUDA graph can capture the call."""

    def __init__(
        self, sg: types.ModuleType, q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, splits: int, kv_lora: int,
        index_dtype: torch.dtype = torch.int64,
    ) -> None:  # fmt: skip
        B, H, C = q.shape
        L = slots.shape[1]
        self.sg, self.q, self.splits, self.scale = sg, q, splits, C**-0.5
        self.k = kv.view(kv.shape[0], 1, C)
        self.v = self.k[..., :kv_lora]
        self.indptr = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=q.device)
        self.indices = slots.reshape(-1).to(index_dtype).contiguous()
        self.out = torch.empty(B, H, kv_lora, dtype=q.dtype, device=q.device)
        self.logits = torch.empty(B, H, splits, kv_lora, dtype=torch.float32, device=q.device)
        self.lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        self.num_splits = torch.full((B,), splits, dtype=torch.int32, device=q.device)

    def __call__(self) -> torch.Tensor:
        self.sg.decode_attention_fwd(
            self.q, self.k, self.v, self.out, self.indptr, self.indices, self.logits, self.lse, self.num_splits,
            self.splits, self.scale, 1.0, 1.0,  # k_scale, v_scale: a bf16 cache, unscaled
        )  # fmt: skip
        return self.out


def request_slots(inp: DecodeInputs, L: int) -> torch.Tensor:
    """[B, L] int32: each request's cache slots in request order (SGLang's flattened kv_indices)."""
    return inp.req_to_token[inp.req_pool_indices, :L]


def run(args: argparse.Namespace) -> dict[str, Any]:
    timer = Timer(args.device, rep_ms=args.rep, cpu_reps=1)
    sg = load_sglang(args.sglang) if args.sglang else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count if args.device == "cuda" else 4
    copy_gbs = measure_ceilings(timer).copy_gbs  # measured in this run: the % columns' denominator
    kv_lora, C = args.kv_lora, args.kv_lora + args.rope
    scale = C**-0.5
    res: dict[str, Any] = {"copy_GBs": copy_gbs, "sglang": args.sglang, "cells": []}
    print(f"copy {copy_gbs:.0f} GB/s", flush=True)
    for H in args.heads:
        gluon = args.device == "cuda"
        tile = default_decode_tile(H, torch.bfloat16, use_gluon=gluon, kv_lora=kv_lora, rope=args.rope, page_size=64)
        tile1 = default_decode_tile(H, torch.bfloat16, use_gluon=gluon, kv_lora=kv_lora, rope=args.rope, page_size=1)
        # both against the fp32 reference on 9 requests of 1k keys (the first cell's layout, smaller)
        inp = decode_cell(9, args.check_len, H, args.device, kv_lora=kv_lora, rope=args.rope)
        ref = mla_decode_ref(inp.q.float(), inp.kv_cache.float(), *inp[2:], kv_lora, scale)
        errs = {name: rel_err(mla_decode(*inp, kv_lora, scale, 3, t), ref)
                for name, t in (("r3trace", tile), ("r3trace/page1", tile1))}  # fmt: skip
        if sg is not None:
            slots = request_slots(inp, args.check_len)
            for s in (1, 4):
                for d in (torch.int32, torch.int64):
                    call = SglangCall(sg, inp.q, inp.kv_cache, slots, s, kv_lora, d)
                    errs[f"sglang/{s}/{str(d)[6:]}"] = rel_err(call(), ref)
        print(f"H={H} normwise error vs the fp32 reference: {errs}", flush=True)
        for B, L in args.cells:
            cell = rotated_decode_cell(B, L, H, args.device, kv_lora, args.rope)
            inp, kvs = cell.inp, cell.caches
            splits = tile.num_kv_splits(B, H, L, sms)
            ours = timer.graph_ms(cell.calls(kv_lora, scale, splits, tile))
            s1 = tile1.num_kv_splits(B, H, L, sms)
            ours1 = timer.graph_ms(cell.calls(kv_lora, scale, s1, tile1))
            pct_copy, tflops = cell.rates(ours, copy_gbs)
            row = {"H": H, "B": B, "L": L, "MB": cell.nbytes / 1e6, "r3trace_splits": splits, "r3trace_ms": ours,
                   "r3trace_page1_ms": ours1, "r3trace_page1_splits": s1, "r3trace_pct_copy": pct_copy,
                   "r3trace_TFLOPs": tflops}
            if sg is not None:
                # SGLang's backends build kv_indices as int32 or int64 (both seen in its code); its kernel multiplies
                # the loaded slot by the row stride in that type, so int32 is faster but wraps past 2^31 / 576 = 3.7M
                # slots (B256/32k has 8.4M): timed both where int32 is safe, the faster kept
                slots = request_slots(inp, L)
                dtypes = [torch.int64] + ([torch.int32] if inp.kv_cache.numel() < 2**31 else [])
                theirs = {f"{s}/{str(d)[6:]}": timer.graph_ms([SglangCall(sg, inp.q, c, slots, s, kv_lora, d)
                                                                for c in kvs])
                          for s in SGLANG_SPLITS for d in dtypes}  # fmt: skip
                best = min(theirs, key=theirs.__getitem__)
                row |= {"sglang_ms": theirs, "sglang_best": best, "speedup": theirs[best] / ours}
                row["sglang_pct_copy"], row["sglang_TFLOPs"] = cell.rates(theirs[best], copy_gbs)
            res["cells"].append(row)
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=1))
            theirs_txt = (f" | sglang best {row['sglang_ms'][row['sglang_best']]:.4f} at {row['sglang_best']} "
                          f"({row['sglang_pct_copy']:.0f}%) | {row['speedup']:.2f}x") if sg is not None else ""
            print(f"H={H} B={B} L={L}: r3trace {ours:.4f} ms ({row['r3trace_pct_copy']:.0f}% of copy, "
                  f"{row['r3trace_TFLOPs']:.0f} TFLOP/s; page 1 {ours1:.4f}){theirs_txt}", flush=True)
            del kvs, inp, cell
        res[f"errors_H{H}"] = errs
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang", default="", help="SGLang's triton_ops/decode_attention.py (required but in --smoke)")
    add_peer_args(ap)
    args = ap.parse_args(argv)
    if not args.sglang and not args.smoke:
        ap.error("--sglang PATH is required (SGLang's srt/layers/attention/triton_ops/decode_attention.py)")
    args.device = "cpu" if args.smoke else "cuda"
    args.kv_lora, args.rope, args.check_len = (32, 16, 20) if args.smoke else (512, 64, 1024)
    args.heads = [16] if args.smoke else [int(h) for h in args.heads.split(",")]
    cells = "2x40" if args.smoke else args.cells
    args.cells = parse_cells(cells)
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse(argv))


if __name__ == "__main__":
    main()
