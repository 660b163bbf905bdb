"""MLA decode attention over the paged latent KV cache: split-KV flash decoding (stage 1, then a merge).

Which kernel runs by default (default_decode_tile; the engine's attention backend resolves it once, resolve_decoder,
and every layer calls the same MlaDecoder). H: query heads on this rank; "Gluon shape": bf16/fp16, kv_lora in
{128, 256, 512}, rope a power of two in 16..128; page: the KV pool's page size. Figures: BENCHMARKS.md#mla-decode.

| H     | GPU    | dtype, latent shape  | page   | stage 1 (record, file)    | tile; splits; merge                   |
| ----- | ------ | -------------------- | ------ | ------------------------- | ------------------------------------- |
| >= 64 | Hopper | Gluon shape, rope 64 | k x 64 | seesaw, seesaw.py         | 64 x 64, 8 warps; by cost; merge      |
|       |        |                      |        |                           | kernel, none at one split (direct)    |
| >= 64 | Hopper | Gluon shape          | other  | wide, wide.py (TMA tiles  | as seesaw                             |
|       |        |                      |        | at k x 64, else cp.async) |                                       |
| < 64  | Hopper | Gluon shape          | k x 64 | narrow, narrow.py (TMA)   | 16 x 64, 4 warps; by cost; 2 splits   |
|       |        |                      |        |                           | merged in a cluster; PDL              |
| >= 64 | any    | bf16, fp16 (fp32)    | any    | triton, triton_stage1.py  | 64 x 64 (fp32 x 32), 8 warps; 8 waves |
| < 64  | any    | bf16, fp16           | any    | triton                    | 16 x 32, 4 warps, 3 stages; by cost;  |
|       |        |                      |        |                           | PDL                                   |
| < 64  | any    | fp32                 | any    | triton                    | 16 x 32, 4 warps; 4 whole waves       |

"any" GPU includes Hopper where the row above does not apply, and the CPU interpreter (TRITON_INTERPRET=1), which
runs only the Triton stage 1: Gluon kernels need an sm_90 GPU. EngineConfig.decode_kernel="triton" keeps the Triton
stage 1 everywhere.

Files: decode.py (mla_decode, MlaDecoder, resolve_decoder), registry.py (the stage-1 records), tile.py (DecodeTile,
the default table, split counts), merge.py (stage 2), reference.py (mla_decode_ref: the one reference), one file per
stage 1 with its tile steps beside it (wide_tile.py, narrow_tile.py, seesaw_tile.py), latent_tiles.py (how the
Gluon kernels load q and the cache) and cluster_merge.py (splits merged inside a thread-block cluster).
fixed_split.py is EngineConfig.batch_invariant's decode: the Triton stage 1 cut at fixed 256-key splits for every row
(decode, verify and prefill rows alike) and a merge in split order, so no row's bits follow the batch or the SMs.
"""

from r3trace.kernels.mla_decode.decode import MlaDecoder, mla_decode, resolve_decoder
from r3trace.kernels.mla_decode.reference import latent_attention_ref, mla_decode_ref
from r3trace.kernels.mla_decode.registry import DecodeShape, Stage1, stage1
from r3trace.kernels.mla_decode.tile import DecodeTile, choose_num_kv_splits, default_decode_tile

__all__ = [
    "DecodeShape", "DecodeTile", "MlaDecoder", "Stage1", "choose_num_kv_splits", "default_decode_tile",
    "latent_attention_ref", "mla_decode", "mla_decode_ref", "resolve_decoder", "stage1",
]  # fmt: skip
