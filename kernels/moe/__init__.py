"""Fused MoE: the grouped path (align, grouped GEMMs, sum over K) and the gemv decode path.

Which kernels run. The engine's `triton` MoE backend resolves a MoePlan once (registry.py: the gemv and grouped
records, the T threshold gemv_max_tokens(I) and the gemv tile of each T under it) and every MoE layer calls it; a
call compares T with the threshold and takes the grouped tiles from grouped_config (host arithmetic, no device
sync). fused_moe(config=None) makes the same choice per call (moe_config). T tokens, K top-k, E experts on this rank,
I moe_intermediate_size, D hidden; rows = T K / E, the mean pairs per expert. Figures: BENCHMARKS.md#fused-moe.

| T                    | I      | record  | kernels (file)                                      | tiles (config.py)    |
| -------------------- | ------ | ------- | --------------------------------------------------- | -------------------- |
| 1                    | > 256  | gemv    | gate_up gemv, down+sum gemv (gemv.py): 2 launches   | GEMV_WIDE            |
| 1-2                  | <= 256 | gemv    | as above                                            | GEMV_T1, evict_first |
| 3-4                  | <= 256 | gemv    | as above                                            | GEMV_T4              |
| else (or T unknown)  | any    | grouped | moe_align (align.py), gate_up and down (gemm.py),   | grouped_config: by   |
|                      |        |         | moe_sum (fused_moe.py): 4-5 launches                | rows, D and dtype    |

The grouped tiles by rows per expert are grouped_config's table (BLOCK_M 16 below 16 rows up to 128 from 128 rows,
TMA weight tiles from 128 rows, the short-D tiles at D <= 4096); align_tile picks the align launch (one-hot chunks of
32 pairs up to 2048 pairs and 256 experts, LARGE_ALIGN above); up to 2048 pairs every kernel launches as a
programmatic dependent on sm_90+. The engine's `ref` backend calls fused_moe_ref (reference.py), the one reference
the kernels' tests compare against.
"""

from r3trace.kernels.moe.config import AlignTile, GemmTile, GemvTile, MoeConfig, grouped_config, moe_config
from r3trace.kernels.moe.fused_moe import fused_moe, moe_sum
from r3trace.kernels.moe.reference import fused_moe_ref
from r3trace.kernels.moe.registry import MoeKernel, MoePlan, MoeShape, resolve_moe

__all__ = [
    "AlignTile", "GemmTile", "GemvTile", "MoeConfig", "MoeKernel", "MoePlan", "MoeShape", "fused_moe", "fused_moe_ref",
    "grouped_config", "moe_config", "moe_sum", "resolve_moe",
]  # fmt: skip
