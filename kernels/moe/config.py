"""Fused MoE tiles and the choice among them (fused_moe.py runs them; the package docstring has the table).

Two paths:
  grouped (any T): align pairs by expert, grouped GEMMs gate_up and down over BLOCK_M blocks, sum over K.
  gemv (decode): no align, no sum launch. One program per (pair, BLOCK_N rows of w13) streams D, then one
    per (token, BLOCK_N rows of w2) loops over the token's K experts, weights them and sums: 2 launches.
    Each pair reads its expert's weights itself, so it only pays where pairs rarely share an expert.
Every figure below is an H200, graph-timed (us or ms a call, weights from HBM); BENCHMARKS.md#fused-moe.
"""

from __future__ import annotations

from typing import NamedTuple

ALIGN_MAX_PAIRS = 2048  # up to this many pairs (and ALIGN_MAX_EXPERTS experts) align_tile's decode-sized launch
ALIGN_MAX_EXPERTS = 256


class GemmTile(NamedTuple):
    """One grouped GEMM's tiles; BLOCK_M is shared (it is the alignment's padding unit)."""

    block_n: int
    block_k: int
    group_m: int  # blocks of M walked together so their weight tiles stay in L2
    num_warps: int
    num_stages: int
    interleave: bool = False  # gate_up only: one N = 2 BLOCK_N product instead of two of BLOCK_N
    n_split: int = 0  # down only, used when block_k >= I: A read once, n_split programs per block walk N
    tma: bool = False  # weight tiles through TMA descriptors (pointer loads where strides are not 16-byte multiples)
    row_dot: bool = False  # the batch-invariant plan's: dot.row_mma (a row's bits apart from its tile, interpreter too)


class GemvTile(NamedTuple):
    """The gemv path's tiles: [BLOCK_N, BLOCK_K] weight tiles, fp32 lanes reduced once at the end."""

    up_n: int  # rows of w13's gate (and as many of up) per program
    up_k: int
    up_warps: int
    down_n: int  # rows of w2 per program
    down_k: int
    down_warps: int
    up_evict_first: bool = False  # w13 loads hinted evict_first in the L2 (read once: they make way first)
    down_evict_first: bool = False  # the same for the down's w2 loads


class AlignTile(NamedTuple):
    """moe_align's launch shape (align.py). AlignTile() is the launch above ALIGN_MAX_PAIRS pairs or
    ALIGN_MAX_EXPERTS experts: one-hot steps of ONE_HOT_ELEMS ints, chunks of 8 steps, 8 warps."""

    one_tile_pairs: int = 0  # M <= this: one program counts and scatters from one [M, E] one-hot tile
    sub: int = 0  # else: one-hot tile rows per step (0: ONE_HOT_ELEMS // BLOCK_E)
    chunk: int = 0  # else: pairs per program (0: 8 tiles, at most MAX_CHUNKS programs)
    num_warps: int = 8  # a large tile's step is bound by its cross-warp reductions' latency


LARGE_ALIGN = AlignTile()  # the launch above ALIGN_MAX_PAIRS pairs or ALIGN_MAX_EXPERTS experts


class MoeConfig(NamedTuple):
    block_m: int
    gate_up: GemmTile
    down: GemmTile
    gemv: GemvTile | None = None  # set: the align-free decode path (block_m, gate_up, down unused)
    align: AlignTile = LARGE_ALIGN
    pdl: bool = False  # align, GEMMs and sum launched as programmatic dependents (sm_90+): each waits first


# Short D (D <= SHORT_D, I >= 512, bf16, below 64 rows per expert; measured at the end-to-end model's D = 2048,
# E = 64 / 66, I = 512, K = 6 / 8): with D = 2048 the gate_up is 8 steps of BLOCK_K 256, so each program's pipeline
# fill and drain weigh more than at D = 7168. down: 128 x 128 tiles, TMA weights, 3 stages at BLOCK_M 16 (T = 64 36.0
# vs 38.3 us for the D = 7168 tile), 2 at BLOCK_M 32 (T = 128 / 256 of the real shape 125.1 / 133.3 vs 126.0 / 134.1
# us a pipeline). gate_up: (32, 256) at BLOCK_M 16, 2 stages with TMA weights up to SHORT_D_FEW_ROWS rows per expert
# (real shape T = 16 91.6 vs 94.8 us), 3 stages without at 7.8 rows (118.0 vs 116.9 for the 2-stage one); from 8 rows
# BLOCK_M 32 with gate and up interleaved and TMA weights (12 rows: 66.4 vs 69.6 us). SHORT_D_FEW_ROWS = 7 splits
# the two measurements (6 and 7.8 rows); nothing between them was timed.
SHORT_D = 4096
SHORT_D_FEW_ROWS = 7
SHORT_D_UP_FEW = GemmTile(32, 256, 1, 4, 2, tma=True)
SHORT_D_UP_BM16 = GemmTile(32, 256, 1, 4, 3)
SHORT_D_UP_BM32 = GemmTile(64, 128, 1, 4, 3, True, tma=True)
SHORT_D_DOWN = GemmTile(128, 128, 1, 4, 3, tma=True)
SHORT_D_DOWN_BM32 = GemmTile(128, 128, 1, 4, 2, tma=True)


def align_tile(num_pairs: int, num_experts: int) -> AlignTile:
    """moe_align's launch: up to ALIGN_MAX_PAIRS pairs and ALIGN_MAX_EXPERTS experts, 32-pair programs on [32, E]
    one-hot tiles, 4 warps (two launches), or, where all pairs fit one [M, E] tile of 8192 ints, one program that counts
    and ranks from that tile; above, LARGE_ALIGN (small chunks would be many programs each re-reading every chunk's
    counts). Alone at E = 64 / K = 6, T = 64: 6.1 vs 8.3 us for LARGE_ALIGN; in the pipeline at the engine's real
    shape (E = 66, K = 8), T = 64: 116.9 vs 120.0 us with 64-pair chunks."""
    if num_pairs > ALIGN_MAX_PAIRS or num_experts > ALIGN_MAX_EXPERTS:
        return LARGE_ALIGN
    block_e = 1 << (num_experts - 1).bit_length()
    return AlignTile(one_tile_pairs=8192 // block_e, sub=32, chunk=32, num_warps=4)


def grouped_config(num_pairs: int, num_experts: int, itemsize: int = 2, inter: int = 0, hidden: int = 0) -> MoeConfig:
    """Grouped-path tiles by the mean rows per expert (num_pairs / num_experts), measured at D = 7168 in bf16
    (BENCHMARKS.md#fused-moe), the two GEMMs tuned apart:

    | rows per expert        | BLOCK_M | gate_up                                  | down                              |
    | ---------------------- | ------- | ---------------------------------------- | --------------------------------- |
    | < 16                   | 16      | 32 x 256, 3 stages                       | 64 x 128, 4 stages                |
    | < 64 (< 32 at I <= 256)| 32      | 64 x 128 (I <= 256: interleaved 128 x 64)| 64 x 128                          |
    | 32-63, bf16, I <= 256  | 64      | interleaved 128 x 64, TMA                | whole-K split, TMA                |
    | 64-127 (but the above) | 64      | 256 x 64                                 | 128 x 64                          |
    | else                   | 128     | interleaved 128 x 64, TMA                | 256 x 64, TMA                     |

    Decode sizes want BLOCK_M 16 (the tensor cores' minimum) and many programs streaming weights (gate_up 32 x 256
    0.033 ms vs 64 x 128 0.040 at E = 256, T = 1); from 128 rows BLOCK_M 128 beats 64 despite more padding (E = 256,
    T = 4k: 1.26 vs 1.39 ms for the two GEMMs), with TMA weights (gate_up 3.18 vs 3.63 ms at E = 32, T = 4k). I <= 256
    in bf16: the down holds the whole K in one tile and walks N (E = 256, T = 16k: 1.36 vs 1.71 ms); 32-63 rows there
    take BLOCK_M 64 with TMA weights (T = 1k: 0.786 vs 0.867 ms for BLOCK_M 32; SGLang's Triton MoE 0.800). fp32 halves
    BLOCK_K and never takes the whole-K down (its stages would need 295 KB of shared memory, over the H200's 227 KB).
    hidden = D <= SHORT_D with I >= 512 in bf16 below 64 rows: the SHORT_D tiles (hidden = 0, unknown: the table).
    Up to ALIGN_MAX_PAIRS pairs every kernel launches as a programmatic dependent (pdl: D = 2048, T = 64 109.2 vs
    112.1 us)."""
    rows = num_pairs / max(1, num_experts)
    align = align_tile(num_pairs, num_experts)
    pdl = num_pairs <= ALIGN_MAX_PAIRS and num_experts <= ALIGN_MAX_EXPERTS  # decode sizes: programmatic dependents
    whole_k_bf16 = itemsize == 2 and 0 < inter <= 256  # the down holds the whole K: E = 256 / I = 256 under TP8
    if itemsize == 2 and 0 < hidden <= SHORT_D and inter >= 512 and rows < 64:
        if rows < 8:
            up = SHORT_D_UP_FEW if rows < SHORT_D_FEW_ROWS else SHORT_D_UP_BM16
            return MoeConfig(16, up, SHORT_D_DOWN, align=align, pdl=pdl)
        return MoeConfig(32, SHORT_D_UP_BM32, SHORT_D_DOWN_BM32, align=align, pdl=pdl)
    if rows < 16:
        bm, up, down, whole_k = 16, GemmTile(32, 256, 1, 4, 3), GemmTile(64, 128, 1, 4, 4), 16
    elif rows < (32 if whole_k_bf16 else 64):  # gate_up interleaved measured only at I = 256 (E = 256, T = 1k)
        up = GemmTile(128, 64, 4, 4, 4, True) if 0 < inter <= 256 else GemmTile(64, 128, 4, 4, 4)
        bm, down, whole_k = 32, GemmTile(64, 128, 4, 4, 4), 8
    elif whole_k_bf16 and rows < 64:
        bm, up, whole_k = 64, GemmTile(128, 64, 8, 8, 3, True, tma=True), 4
        down = GemmTile(64, 256, 8, 8, 3, n_split=whole_k, tma=True)  # as the whole-K down below makes it
    elif rows < 128 and not whole_k_bf16:
        bm, up, down, whole_k = 64, GemmTile(256, 64, 8, 8, 3), GemmTile(128, 64, 8, 4, 4), 4
    else:
        bm, up, down, whole_k = 128, GemmTile(128, 64, 8, 8, 3, True, tma=True), GemmTile(256, 64, 8, 8, 3, tma=True), 4
    if itemsize >= 4:
        up, down = up._replace(block_k=up.block_k // 2), down._replace(block_k=down.block_k // 2)
    elif 0 < inter <= 256:
        down = GemmTile(64, 256, min(8, up.group_m), up.num_warps, 3, n_split=whole_k, tma=up.tma)
    return MoeConfig(bm, up, down, align=align, pdl=pdl)


# The batch-invariant plan's tiles (registry.py's resolve_moe(invariant=True)): a pair's bits may not depend on T.
# Each GEMM's 16-wide MMA steps accumulate into one fp32 accumulator in K order (Triton folds `acc += dot(a, w)` into
# the dot's acc operand), so BLOCK_K only groups the same steps and BLOCK_M / BLOCK_N only say which rows and columns
# a program owns: the default plan's grouped tiles give a pair the same bits at every T. Measured on the H200 at D =
# 2048, I = 512, E = 64, K = 6: grouped_config's tiles at T = 1..4096 (BLOCK_M 16-128, BLOCK_K 64-256, the SHORT_D
# tiles, TMA, interleaved gate_up) equal a plan fixed at BLOCK_K 64 bit for bit, as do all 9 (gate_up, down) BLOCK_K
# pairs of 64 / 128 / 256 at T = 64; tests/kernels/test_batch_invariance.py crosses BLOCK_K and BLOCK_M there. A
# pipeline at T = 64 took 103.5 us on these tiles against 107.0 on the BLOCK_K 64 ones (graph-timed, same run). The
# gemv path is never taken: its fp32 lanes sum K in another order.
def invariant_config(grouped: MoeConfig, pairs: int, experts: int, itemsize: int, inter: int, hidden: int,
                     compiled: bool) -> MoeConfig:  # fmt: skip
    """The invariant plan's tiles for a call of `pairs` pairs on `experts` experts, given the default plan's `grouped`
    tiles for it: 16-bit, those tiles (row_dot, so the CPU interpreter sums a row's products alike); fp32 and Triton's
    CPU interpreter (compiled=False), the decode-size tiles at every T (the interpreter sums a row_mma's BLOCK_K
    products before adding them, so its bits follow BLOCK_K; fp32's 'ieee' products are not the tensor cores' and were
    not measured across tiles). The alignment's launch shape and PDL stay grouped's."""
    fixed = itemsize >= 4 or not compiled
    cfg = grouped_config(0, max(1, experts), itemsize, inter, hidden) if fixed else grouped
    cfg = cfg._replace(gate_up=cfg.gate_up._replace(row_dot=True), down=cfg.down._replace(row_dot=True))
    return cfg._replace(align=grouped.align, pdl=grouped.pdl)


# The gemv tiles (D = 7168, K = 8, each kernel alone): E = 256 / I = 256, T = 1: up 1 row x 1024 over 2 warps, down 4
# rows over 2 warps, pipeline 0.0363 vs 0.0398 ms for 4-row ups; T <= 4: up 2 rows x 1024, 4 warps; I = 2048, T = 1:
# down 1 row over 1 warp (0.0661 vs 0.0790 ms for 4 rows). Weight loads hinted evict_first (each line read once, so
# it makes way first) at T <= 2: T = 1 0.0320 vs 0.0364 ms with the L2 dirty, a tie clean; at T = 4 and I = 2048 the
# hint loses dirty and ties clean, so GEMV_T4 and GEMV_WIDE stay unhinted.
GEMV_T1 = GemvTile(1, 1024, 2, 4, 256, 2, up_evict_first=True, down_evict_first=True)
GEMV_T4 = GemvTile(2, 1024, 4, 4, 256, 2)
GEMV_WIDE = GemvTile(1, 1024, 2, 1, 256, 1)  # I = 2048: 8 down steps per expert


def gemv_max_tokens(inter: int) -> int:
    """The most tokens the gemv path runs: 4 where I <= 256, 1 above (0 where I is unknown). gemv vs grouped at
    D = 7168, K = 8: E = 256 / I = 256, T = 1 0.036 vs 0.052 ms, T = 4 0.094 vs 0.109, T = 16 0.32 vs 0.28 (grouped);
    E = 32 / I = 2048, T = 1 0.172 vs 0.189, T = 2 0.337 vs 0.310 (grouped)."""
    if inter <= 0:
        return 0
    return 4 if inter <= 256 else 1


def gemv_tile(tokens: int, inter: int) -> GemvTile | None:
    """The gemv path's tiles at `tokens` tokens (None: the grouped path runs there)."""
    if not 1 <= tokens <= gemv_max_tokens(inter):
        return None
    if inter > 256:
        return GEMV_WIDE
    return GEMV_T1 if tokens <= 2 else GEMV_T4


def moe_config(
    num_pairs: int, num_experts: int, itemsize: int = 2, inter: int = 0, tokens: int = 0, hidden: int = 0
) -> MoeConfig:
    """The tiles fused_moe runs by default: the gemv path where gemv_tile has one (tokens <= gemv_max_tokens(I)),
    else grouped_config's. tokens = 0 (unknown) always gives the grouped path; hidden: D, for the short-D tiles (0:
    unknown). The engine resolves the same choice once (registry.py's MoePlan)."""
    grouped = grouped_config(num_pairs, num_experts, itemsize, inter, hidden)
    tile = gemv_tile(tokens, inter)
    return grouped if tile is None else grouped._replace(gemv=tile)
