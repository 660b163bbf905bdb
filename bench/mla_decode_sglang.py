"""r3trace's MLA decode beside SGLang's Triton MLA decode: the same cells, the same inputs, the same run (issue 6's
MLA cells, H200).

Run (GPU): python bench/mla_decode_sglang.py --sglang PATH [--heads 16,128] [--cells BxL,...]
    -> table on stdout, JSON in $OUT/mla_decode_sglang.json

PATH: SGLang's python/sglang/srt/layers/attention/triton_ops/decode_attention.py, fetched beside the project and never
committed (bench/NOTES.md names the commit). Its one SGLang import, sglang.srt.utils.is_hip, gets a stand-in module
answering False (this is a CUDA GPU).

SGLang's call as its Triton attention backend makes it for MLA: k_buffer the latent cache viewed [S, 1, 576], v_buffer
its first 512 columns, kv_indptr / kv_indices the requests' cache slots flattened, fp32 split partials [B, H,
max_splits, 512] and LSEs, every request at the same split count. SGLang picks that count per request from lengths and
the SM count, capped by --triton-attention-num-kv-splits (8 by default); here it is timed at 1, 2, 4, 8 and 16, with
int32 and int64 kv_indices (main() says why), and the fastest taken: the baseline's best case. r3trace: mla_decode with
the engine's Hopper tile on 64-slot pages (default_decode_tile(H, bf16, use_gluon=True, page_size=64)) at its own split
count, and the tile the engine takes at its default page size of 1 (r3trace_page1_ms). All are timed the same way
(mla_decode_floor.graph_ms: one CUDA graph of back-to-back calls, median; caches rotated over copies spanning >= 4x the
L2 at small cells) on the same shuffled 64-slot pages, and checked against mla_decode_ref first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from functools import partial
from pathlib import Path

import torch
from sibling import load_path, load_sibling  # bench/sibling.py: python bench/<script>.py puts bench/ on the path

from r3trace.kernels.mla_decode import default_decode_tile, mla_decode, mla_decode_ref

KV_LORA, ROPE = 512, 64
CELLS = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)]
SGLANG_SPLITS = (1, 2, 4, 8, 16)
SCALE = (KV_LORA + ROPE) ** -0.5


def load_sglang(path: str) -> types.ModuleType:
    """SGLang's decode_attention.py as a module, its sglang.srt.utils import answered by a stand-in."""
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_hip = lambda: False  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["sglang.srt.utils"] = utils
    return load_path(Path(path), "sglang_decode_attention")


class SglangCall:
    """decode_attention_fwd on r3trace's inputs (q [B, H, 576], the cache [S, 576], req_to_token [B, L]), all buffers
    made once so a CUDA graph can capture the call."""

    def __init__(
        self, sg: types.ModuleType, q: torch.Tensor, kv: torch.Tensor, r2t: torch.Tensor, splits: int,
        index_dtype: torch.dtype = torch.int64,
    ) -> None:  # fmt: skip
        B, H, _ = q.shape
        L = r2t.shape[1]
        self.sg, self.q, self.splits = sg, q, splits
        self.k = kv.view(kv.shape[0], 1, KV_LORA + ROPE)
        self.v = self.k[..., :KV_LORA]
        self.indptr = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device="cuda")
        self.indices = r2t.reshape(-1).to(index_dtype).contiguous()
        self.out = torch.empty(B, H, KV_LORA, dtype=q.dtype, device="cuda")
        self.logits = torch.empty(B, H, splits, KV_LORA, dtype=torch.float32, device="cuda")
        self.lse = torch.empty(B, H, splits, dtype=torch.float32, device="cuda")
        self.num_splits = torch.full((B,), splits, dtype=torch.int32, device="cuda")

    def __call__(self) -> torch.Tensor:
        self.sg.decode_attention_fwd(
            self.q, self.k, self.v, self.out, self.indptr, self.indices, self.logits, self.lse, self.num_splits,
            self.splits, SCALE, 1.0, 1.0,  # k_scale, v_scale: a bf16 cache, unscaled
        )  # fmt: skip
        return self.out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.float() - ref.float()).norm() / ref.float().norm()).item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang", required=True, help="SGLang's triton_ops/decode_attention.py")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--cells", default="", help="BxL,... (default: the nine issue-6 cells)")
    ap.add_argument("--rep", type=int, default=20, help="ms of replays per retry (do_bench_cudagraph)")
    args = ap.parse_args()
    fl = load_sibling("mla_decode_floor.py", "mla_floor")
    bk = load_sibling("kernels.py", "bench_kernels")
    sg = load_sglang(args.sglang)
    cells = [tuple(int(x) for x in c.split("x")) for c in args.cells.split(",")] if args.cells else CELLS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_gbs = fl.floors(args.rep)["copy_1GiB_GBps"]  # measured in this run: the % columns' denominator
    res: dict[str, object] = {"copy_GBs": copy_gbs, "sglang": args.sglang, "cells": []}
    print(f"copy {copy_gbs:.0f} GB/s", flush=True)
    for H in (int(h) for h in args.heads.split(",")):
        tile = default_decode_tile(H, torch.bfloat16, use_gluon=True, page_size=64)
        tile1 = default_decode_tile(H, torch.bfloat16, use_gluon=True, page_size=1)  # the engine's default pages
        # both against the fp32 reference on 9 requests of 1000 keys (the first cell's layout, smaller)
        q, kv, r2t, rows, lens = bk._decode_inputs(9, 1024, H)
        ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, lens, KV_LORA, SCALE)
        errs = {name: rel_err(mla_decode(q, kv, r2t, rows, lens, KV_LORA, SCALE, 3, t), ref)
                for name, t in (("r3trace", tile), ("r3trace/page1", tile1))}  # fmt: skip
        errs |= {f"sglang/{s}/{str(d)[6:]}": rel_err(SglangCall(sg, q, kv, r2t, s, d)(), ref)
                 for s in (1, 4) for d in (torch.int32, torch.int64)}  # fmt: skip
        print(f"H={H} normwise error vs the fp32 reference: {errs}", flush=True)
        for B, L in cells:
            nbytes = B * L * (KV_LORA + ROPE) * 2
            flops = 2 * B * H * L * (KV_LORA + ROPE + KV_LORA)
            q, kv, r2t, rows, lens = bk._decode_inputs(B, L, H)
            kvs = [kv] + [torch.randn_like(kv) for _ in range(fl.copies_for(nbytes) - 1)]
            splits = tile.num_kv_splits(B, H, L, sms)
            ours = fl.graph_ms([partial(mla_decode, q, c, r2t, rows, lens, KV_LORA, SCALE, splits, tile) for c in kvs],
                               args.rep)  # fmt: skip
            s1 = tile1.num_kv_splits(B, H, L, sms)
            ours1 = fl.graph_ms([partial(mla_decode, q, c, r2t, rows, lens, KV_LORA, SCALE, s1, tile1) for c in kvs],
                                args.rep)  # fmt: skip
            # SGLang's backends build kv_indices as int32 or int64 (both seen in its code); its kernel multiplies the
            # loaded slot by the row stride in that type, so int32 is ~1.8x faster but wraps past 2^31 / 576 = 3.7M
            # slots (B256/32k has 8.4M): timed both where int32 is safe, the faster kept
            dtypes = [torch.int64] + ([torch.int32] if kv.shape[0] * kv.stride(0) < 2**31 else [])
            theirs = {f"{s}/{str(d)[6:]}": fl.graph_ms([SglangCall(sg, q, c, r2t, s, d) for c in kvs], args.rep)
                      for s in SGLANG_SPLITS for d in dtypes}  # fmt: skip
            best = min(theirs, key=theirs.__getitem__)
            row = {"H": H, "B": B, "L": L, "MB": nbytes / 1e6, "r3trace_splits": splits, "r3trace_ms": ours,
                   "r3trace_page1_ms": ours1, "r3trace_page1_splits": s1,
                   "sglang_ms": theirs, "sglang_best": best, "speedup": theirs[best] / ours,
                   "r3trace_pct_copy": 100 * nbytes / ours / 1e6 / copy_gbs,
                   "sglang_pct_copy": 100 * nbytes / theirs[best] / 1e6 / copy_gbs,
                   "r3trace_TFLOPs": flops / ours / 1e9, "sglang_TFLOPs": flops / theirs[best] / 1e9}  # fmt: skip
            res["cells"].append(row)  # type: ignore[attr-defined]
            (out_dir / "mla_decode_sglang.json").write_text(json.dumps(res, indent=1))
            print(f"H={H} B={B} L={L}: r3trace {ours:.4f} ms ({row['r3trace_pct_copy']:.0f}% of copy, "
                  f"{row['r3trace_TFLOPs']:.0f} TFLOP/s; page 1 {ours1:.4f}) | sglang best {theirs[best]:.4f} "
                  f"at {best} "
                  f"({row['sglang_pct_copy']:.0f}%, {row['sglang_TFLOPs']:.0f}) | {row['speedup']:.2f}x | sglang "
                  + " ".join(f"{s}:{t:.4f}" for s, t in theirs.items()), flush=True)  # fmt: skip
            del kvs, q, kv
            torch.cuda.empty_cache()
        res[f"errors_H{H}"] = errs
        (out_dir / "mla_decode_sglang.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
