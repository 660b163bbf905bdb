"""MLA attention of a speculative verify (B requests of 4 rows after a prefix of L keys), one CUDA-graph replay a call:
the default backend's short extends (kernels/mla_decode/short_extend.py: token-block stage 1, a split count from a cost
model, each block's split size cut on the device) at split floors 64 (the backend's) and 128, beside the same stage 1
with splits sized from the host's bound on the lengths (a graph's longest context, 8,192 here), every row as a decode
of its own keys (the backend's short extends at H >= 64), the extend kernel
(kernels/mla_extend.py), and the decode kernel for one row a request (what a plain decode step's attention costs).
bf16, kv_lora 512, rope 64.

Run (H200, about a minute): python -m bench.short_extend --out bench/results/short_extend-h200.json
Smoke (CPU, Triton's interpreter): --smoke checks every variant against the extend kernel at a tiny shape, untimed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton

from bench.inputs import paged_req_to_token
from bench.moe_verify_tiles import graph_us
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.kernels.mla_decode import resolve_decoder
from r3trace.kernels.mla_decode.fixed_split import SPLIT_KEYS, FixedSplitDecoder
from r3trace.kernels.mla_decode.registry import DecodeShape
from r3trace.kernels.mla_decode.short_extend import ShortExtendDecoder
from r3trace.kernels.mla_decode.token_block import token_block_tile
from r3trace.kernels.mla_extend import mla_extend

ROWS = 4  # d + 1 at d = 3
HOST_MAX = 8192  # the host's bound on a graph's lengths: its longest context
SPLITS = 16  # the host-sized path's and the dynamic path's most splits


def verify_batch(batch: int, prefix: int, heads: int, kv_lora: int, rope: int, device: str,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:  # fmt: skip
    """q [B x ROWS, H, C], the latent cache, and the ForwardBatch of B requests of ROWS rows after `prefix` keys."""
    gen = torch.Generator().manual_seed(seed)
    lens = [prefix + ROWS] * batch
    req_to_token, rows, slots = paged_req_to_token(lens, 1, gen)
    q = torch.randn(batch * ROWS, heads, kv_lora + rope, generator=gen).to(device, torch.bfloat16)
    kv = torch.randn(slots, kv_lora + rope, generator=gen).to(device, torch.bfloat16)
    out_loc = torch.cat([req_to_token[r, prefix : prefix + ROWS] for r in rows.tolist()])
    fb = ForwardBatch.build(forward_id=0, input_ids=[0] * q.shape[0], prefix_lens=[prefix] * batch,
                            extend_lens=[ROWS] * batch, req_pool_indices=rows.tolist(), out_cache_loc=out_loc.numpy(),
                            req_to_token=req_to_token.to(device), logits_rows=[q.shape[0] - 1], device=device)
    return q, kv, fb


def variants(heads: int, kv_lora: int, rope: int, device: str, q: torch.Tensor, kv: torch.Tensor, fb: ForwardBatch,
             floors: list[int]) -> dict[str, Callable[[], torch.Tensor]]:  # fmt: skip
    tile = token_block_tile(heads, torch.bfloat16)
    decoder = resolve_decoder(DecodeShape(heads, kv_lora, rope), torch.bfloat16, 1, device)
    scale, b = 0.1, fb.batch_size
    host = FixedSplitDecoder(tile, max(SPLIT_KEYS, triton.cdiv(HOST_MAX // SPLITS, tile.block_n) * tile.block_n))
    args = (fb.req_to_token, fb.req_pool_indices, fb.extend_start_loc, fb.extend_lens, fb.positions + 1)
    last = fb.extend_start_loc + fb.extend_lens - 1  # each request's last row: its decode step
    out: dict[str, Callable[[], torch.Tensor]] = {
        "extend": lambda: mla_extend(q, kv, fb.req_to_token, fb.req_pool_indices, fb.prefix_lens, fb.extend_lens,
                                     fb.extend_start_loc, kv_lora, scale, max_extend_len=ROWS),
        "host_splits": lambda: host(q, kv, *args, kv_lora, scale, HOST_MAX, ROWS),
    }  # fmt: skip
    for floor in floors:
        short = ShortExtendDecoder(tile, floor, SPLITS, decoder.sm_count)
        p = short.num_splits(b, heads, ROWS, HOST_MAX, q.shape[0])
        out[f"dynamic_{floor}"] = partial(short, q, kv, *args, kv_lora, scale, p, ROWS)
    row_pool = fb.req_pool_indices.repeat_interleave(ROWS)
    out["decode_rows"] = partial(decoder, q, kv, fb.req_to_token, row_pool, fb.positions + 1, scale,
                                 decoder.num_kv_splits(q.shape[0], HOST_MAX))  # fmt: skip
    splits = decoder.num_kv_splits(b, HOST_MAX)
    q1 = q[last].contiguous()
    out["decode_1row"] = lambda: decoder(q1, kv, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, scale, splits)
    return out


def smoke() -> None:
    """Every variant at a tiny shape on the CPU against the extend kernel (fp32 accumulation: bf16 output rounding)."""
    q, kv, fb = verify_batch(3, 200, 4, 32, 16, "cpu", seed=0)
    fns = variants(4, 32, 16, "cpu", q, kv, fb, [64, 128])
    ref = fns.pop("extend")().float()
    last = (fb.extend_start_loc + fb.extend_lens - 1).long()
    for name, fn in fns.items():
        got = fn().float()
        want = ref[last] if name == "decode_1row" else ref
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.3g} against the extend kernel"
    print(f"{len(fns)} variants match the extend kernel")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, untimed (make test)")
    ap.add_argument("--heads", type=lambda s: [int(x) for x in s.split(",")], default=[16, 128])
    ap.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--prefix", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024, 4096])
    ap.add_argument("--floors", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    rows = []
    for heads in args.heads:
        for batch in args.batch:
            for prefix in args.prefix:
                q, kv, fb = verify_batch(batch, prefix, heads, 512, 64, "cuda", seed=batch + prefix)
                fns = variants(heads, 512, 64, "cuda", q, kv, fb, args.floors)
                ref = fns["extend"]().float()
                row: dict[str, object] = {"H": heads, "batch": batch, "prefix": prefix}
                for name, fn in fns.items():
                    if name not in ("extend", "decode_1row"):
                        err = ((fn().float() - ref).norm() / ref.norm()).item()
                        if err > 1e-2:
                            row[name] = f"err {err:.3g}"
                            continue
                    row[name] = round(graph_us(fn), 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
