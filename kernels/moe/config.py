"""Fused MoE tiles and the choice among them (kernels/fused_moe.py runs them).

Two paths:
  grouped (any T): align pairs by expert, grouped GEMMs gate_up and down over BLOCK_M blocks, sum over K.
  gemv (decode): no align, no sum launch. One program per (pair, BLOCK_N rows of w13) streams D, then one
    per (token, BLOCK_N rows of w2) loops over the token's K experts, weights them and sums: 2 launches.
    Each pair reads its expert's weights itself, so it only pays where pairs rarely share an expert.
"""

from __future__ import annotations

from typing import NamedTuple


class GemmTile(NamedTuple):
    """One grouped GEMM's tiles; BLOCK_M is shared (it is the alignment's padding unit)."""

    block_n: int
    block_k: int
    group_m: int  # blocks of M walked together so their weight tiles stay in L2
    num_warps: int
    num_stages: int
    interleave: bool = False  # gate_up only: one N = 2 BLOCK_N product instead of two of BLOCK_N
    n_split: int = 0  # down only, used when block_k >= I: A read once, n_split programs per block walk N
    tma: bool = False  # weight tiles (and the down's A tiles when act is sorted) through TMA descriptors


class GemvTile(NamedTuple):
    """The gemv path's tiles: [BLOCK_N, BLOCK_K] weight tiles, fp32 lanes reduced once at the end."""

    up_n: int  # rows of w13's gate (and as many of up) per program
    up_k: int
    up_warps: int
    down_n: int  # rows of w2 per program
    down_k: int
    down_warps: int
    up_stages: int = 1
    down_stages: int = 1
    unroll: bool = False  # loops unrolled (D, I constexpr), each step's loads issued before the last's products
    up_evict_first: bool = False  # w13 loads hinted evict_first in the L2 (read once: they make way first)
    down_evict_first: bool = False  # the same for the down's w2 loads


class AlignTile(NamedTuple):
    """moe_align's launch shape (kernels/moe_align.py); AlignTile() is the layout before session 5."""

    one_tile_pairs: int = 0  # M <= this: one program counts and scatters from one [M, E] one-hot tile
    sub: int = 0  # else: one-hot tile rows per step (0: ONE_HOT_ELEMS // BLOCK_E)
    chunk: int = 0  # else: pairs per program (0: 8 tiles, at most MAX_CHUNKS programs)
    num_warps: int = 8  # before session 5 always 8: a tile step is bound by its cross-warp reductions' latency


class MoeConfig(NamedTuple):
    block_m: int
    gate_up: GemmTile
    down: GemmTile
    gemv: GemvTile | None = None  # set: the align-free decode path (block_m, gate_up, down unused)
    sorted_act: bool = False  # act [P, I] at the pairs' sorted positions: contiguous gate_up stores, down A rows
    align: AlignTile | None = None  # None: AlignTile(), the align launch before session 5
    pdl: bool = False  # align, GEMMs and sum launched as programmatic dependents (sm_90+): each waits first


def same_tiles(block_m: int, block_n: int, block_k: int, group_m: int, warps: int, stages: int) -> MoeConfig:
    """One tile for both GEMMs (the layout before the GEMMs were tuned apart)."""
    tile = GemmTile(block_n, block_k, group_m, warps, stages)
    return MoeConfig(block_m, tile, tile)


# Session 5 (bench/NOTES.md "moee2e, session 5" run 1; the end-to-end model's D = 2048, E = 64, I = 512, K = 6,
# bf16; us per call, 8 calls in one graph, weights from HBM; touched-read 95 us from T = 32 on). With D = 2048
# the gate_up is 8 steps of BLOCK_K 256, so each program's pipeline fill and drain weigh more than at D = 7168.
# gate_up: the committed (32, 256, 1, 4, 3) at BLOCK_M 16 is within 1% of the best of 17 tiles up to T = 64
# (66.1 us at T = 64 for 268 MB: 4.06 TB/s); at 12 rows per expert (T = 128) BLOCK_M 32 with gate/up interleaved
# and TMA weights 66.4 vs 69.6, at 24 rows (T = 256) 69.4 vs the committed (64, 128, 4, 4, 4) 73.5. down: 128 x 128
# tiles, 3 stages, TMA weights won at every T and both BLOCK_M of 17 tiles: T = 64 36.0 vs 38.3, T = 16 29.4 vs
# 31.1, T = 256 (BLOCK_M 32) 40.4 vs 42.8. Measured only at D = 2048 / I = 512: SHORT_D and inter >= 512 bound it.
# Session 6 (bench/NOTES.md "moecand, session 6" run 1; us per call in the same graph timer) timed run 2's part
# winners inside the pipeline at the engine's real shape (the 2 shared experts fused: 66 expert rows, 8 pairs a
# token, experts 64 and 65 on every token) and at K = 6. Down (128, 128, 1, 4, 2, tma) at BLOCK_M 32
# (SHORT_D_DOWN_BM32): real T = 128 / 256 125.1 / 133.3 vs 126.0 / 134.1 with the 3-stage down, K = 6 110.7 / 115.2
# vs 111.6 / 116.7. gate_up (32, 256, 1, 4, 2, tma) at BLOCK_M 16 (SHORT_D_UP_FEW) wins or ties up to 6 rows per
# expert and loses at 7.8: K = 6 T = 16 / 32 / 64 (1.5 / 3 / 6 rows) 87.7 / 104.8 / 108.6 vs 90.5 / 105.0 / 109.5,
# real T = 16 / 32 (1.9 / 3.9) 91.6 / 110.4 vs 94.8 / 111.5, but real T = 64 (7.8 rows: the routed experts' 6 and
# the shared ones' 64) 118.0 vs 116.9 with the 3-stage tile (both on the 32-pair align; 120.8 vs 120.0 on the
# 64-pair one). SHORT_D_FEW_ROWS = 7 splits the two measurements (6 and 7.8 rows); nothing between them was timed
SHORT_D = 4096
SHORT_D_FEW_ROWS = 7
SHORT_D_UP_FEW = GemmTile(32, 256, 1, 4, 2, tma=True)
SHORT_D_UP_BM16 = GemmTile(32, 256, 1, 4, 3)
SHORT_D_UP_BM32 = GemmTile(64, 128, 1, 4, 3, True, tma=True)
SHORT_D_DOWN = GemmTile(128, 128, 1, 4, 3, tma=True)
SHORT_D_DOWN_BM32 = GemmTile(128, 128, 1, 4, 2, tma=True)


def align_tile(num_pairs: int, num_experts: int) -> AlignTile | None:
    """moe_align's launch at decode sizes (bench/NOTES.md "moee2e, session 5" runs 1-2, graph us, 8 route sets): up
    to 2048 pairs and 256 experts, 64-pair programs on [64, E] one-hot tiles, 4 warps (two launches) instead of one
    program walking every pair twice (run 1): E = 64, K = 6: T = 64 7.9 vs 14.2, T = 256 8.0 vs 43.5; E = 256, K = 8:
    T = 64 14.5 vs 38.4 (T = 16: 14.2 vs 14.5); E = 32: T = 64 5.3 vs 8.4. Where all pairs fit one [M, E] tile of 8192
    ints, one program counts and ranks from that tile: E = 32, T = 16 2.6 vs 5.1; E = 64, T = 16 5.8 vs 6.6. None
    (the old launch) above 2048 pairs: there small chunks are many programs each re-reading every chunk's counts.
    Chunks of 32 pairs on [32, E] tiles since session 6 ("moecand, session 6" run 1, whole pipeline, us, 32 vs 64):
    E = 66 / K = 8 (the engine's 2 shared experts fused) T = 64 116.9 vs 120.0, T = 16 91.5 vs 94.8, T = 256 134.1
    vs 137.2; E = 64 / K = 6 T = 64 107.7 vs 109.5; E = 256 / K = 8 / D = 7168 T = 16 278.5 vs 289.8 (the 64-pair
    tile's +2% over the old launch there is gone), T = 256 682.9 vs 690.5; E = 32 / I = 2048 T = 64 671.1 vs 671.4,
    T = 256 850.2 vs 844.2 (+0.7%, a cell whose two timings of one config differ by 1%). Alone (session 5 run 2):
    E = 64 T = 64 6.1 vs 8.3, E = 256 T = 16 8.8 vs 14.3."""
    if num_pairs > 2048 or num_experts > 256:
        return None
    block_e = 1 << (num_experts - 1).bit_length()
    return AlignTile(one_tile_pairs=8192 // block_e, sub=32, chunk=32, num_warps=4)


def grouped_config(num_pairs: int, num_experts: int, itemsize: int = 2, inter: int = 0, hidden: int = 0) -> MoeConfig:
    """Grouped-path tiles by the mean rows per expert (H200 sweeps, bench/NOTES.md "Fused MoE" runs 1-2,
    bf16, D = 7168).

    Decode-sized runs (<= 16 rows) want BLOCK_M 16 (the tensor cores' minimum) and many programs
    streaming weights: gate_up (32, 256) 0.033 ms vs (64, 128) 0.040 ms at E = 256, T = 1. From 128
    rows on BLOCK_M 128 beat 64 at both shapes despite more padding (E = 256, T = 4k: 1.26 vs 1.39 ms
    for the two GEMMs); gate_up with gate and up interleaved into one N = 256 product (E = 32, T = 16k:
    13.55 vs 14.20 ms), down with 128 x 256 tiles (7.22 vs 8.37 ms). inter = I <= 256: down holds the
    whole K in one tile and walks N (E = 256: 1.36 vs 1.71 ms at T = 16k, 0.29 vs 0.49 ms at T = 1k).
    Tier edges moved in "Fused MoE at small T" run 1 (E = 32 / I = 2048, graph ms): 16 rows (T = 64) BLOCK_M
    32 0.680 vs 16 0.800 (64: 0.711, 128: 0.78); 64 rows (T = 256) BLOCK_M 64 0.849 vs 32 1.311 (128: 0.836).

    From 128 rows on the weights come through TMA descriptors (bench/NOTES.md "moebig, session 4" run 1, each
    GEMM alone, ms at T = 4k / 16k): gate_up interleaved 3.18 / 11.81 vs 3.63 / 13.38 with pointer loads at
    E = 32 / I = 2048, 0.667 / 1.772 vs 0.699 / 1.984 at E = 256 / I = 256; down 1.73 / 6.89 vs 1.93 / 7.48
    at E = 32, whole-K split down 0.457 / 1.377 vs 0.470 / 1.392 at E = 256 (the other tiers: not measured).

    fp32 halves BLOCK_K and never takes the whole-K down: the gate_up kernel stages an A tile and two B
    tiles per pipeline stage, and at 4 bytes (16, 64, 128) x 4 stages needs 295 KB of shared memory,
    over the H200's 227 KB (seen on the H200: OutOfResources, required 245760).

    hidden = D <= SHORT_D with I >= 512 in bf16 below 64 rows: the session 5-6 tiles (comment above SHORT_D); hidden
    = 0 (unknown) keeps the tiles above. The align launch: align_tile's, by pairs and experts. Where it applies (<=
    2048 pairs) the kernels launch as programmatic dependents (pdl; session 5 run 2, us, the same tiles without):
    D = 2048, T = 16..256 2.3-3.0% less (T = 64 109.2 vs 112.1), D = 7168 cells 0.1-0.9% less, one +0.15%.
    bf16 at I <= 256 takes TMA weights from 32 rows per expert on (bench/NOTES.md "Session 10", run 7, E = 256,
    pipelines, eager / graph ms): 32 rows (T = 1k) BLOCK_M 64 0.789 / 0.786 against the BLOCK_M 32 tier's 0.869 /
    0.867 (BLOCK_M 32 with TMA 0.845, 128 0.839; SGLang's Triton MoE at its best config 0.800, run 6); 64 rows (T =
    2k) BLOCK_M 128 0.923 / 0.915 against BLOCK_M 64 without TMA 0.992 / 0.991. 16 rows (T = 512) stays at BLOCK_M
    32 (0.757; with TMA 0.745, within a run's spread), 8 rows at 16."""
    rows = num_pairs / max(1, num_experts)
    align = align_tile(num_pairs, num_experts)
    pdl = align is not None  # decode sizes: every kernel a programmatic dependent (MoeConfig.pdl; run 2)
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
    elif whole_k_bf16 and rows < 64:  # session 10 run 7, see the docstring
        bm, up, whole_k = 64, GemmTile(128, 64, 8, 8, 3, True, tma=True), 4
        down = GemmTile(64, 256, 8, 8, 3, n_split=whole_k, tma=True)  # as the whole-K down below makes it
    elif rows < 128 and not whole_k_bf16:  # run 1's BLOCK_M 64 winners
        bm, up, down, whole_k = 64, GemmTile(256, 64, 8, 8, 3), GemmTile(128, 64, 8, 4, 4), 4
    else:  # weights through TMA descriptors (moebig session 4 run 1): see the docstring
        bm, up, down, whole_k = 128, GemmTile(128, 64, 8, 8, 3, True, tma=True), GemmTile(256, 64, 8, 8, 3, tma=True), 4
    if itemsize >= 4:
        up, down = up._replace(block_k=up.block_k // 2), down._replace(block_k=down.block_k // 2)
    elif 0 < inter <= 256:
        down = GemmTile(64, 256, min(8, up.group_m), up.num_warps, 3, n_split=whole_k, tma=up.tma)
    return MoeConfig(bm, up, down, align=align, pdl=pdl)


# Session 3 run 2 (bench/NOTES.md "Fused MoE, session 3"; graph ms, D = 7168, K = 8, each kernel alone): the
# unrolled lanes kernels; E = 256 / I = 256, T = 1: up 1 row x 1024, 2 warps 0.0242 (the committed 4 x 1024, 4
# warps 0.0275; 16 tiles 0.024-0.062), down 4 rows, 2 warps 0.0162 (0.0184; 10 tiles); pipeline 0.0363 vs
# 0.0398. T = 4: up 2 rows x 1024, 4 warps (0.0638, tied with 1 row), pipeline 0.0936. E = 32 / I = 2048,
# T = 1: down 1 row, 1 warp 0.0661 (4 rows, 4 warps 0.0790), pipeline 0.1718 vs grouped 0.1888.
# Session 4 run 2 ("moet1, session 4"; graph ms with the L2 dirty as do_bench leaves it / clean): weight loads
# hinted evict_first in both kernels at E = 256, T = 1 0.0320 vs 0.0364 / 0.0285 vs 0.0289, T = 2 0.0534 vs
# 0.0558 / 0.0475 vs 0.0477; at T = 4 (0.0957 vs 0.0933) and E = 32 / I = 2048 (0.1796 vs 0.1716) they lose
# dirty and tie clean, so GEMV_T4 and GEMV_WIDE stay unhinted
GEMV_T1 = GemvTile(1, 1024, 2, 4, 256, 2, unroll=True, up_evict_first=True, down_evict_first=True)
GEMV_T4 = GemvTile(2, 1024, 4, 4, 256, 2, unroll=True)
GEMV_WIDE = GemvTile(1, 1024, 2, 1, 256, 1, unroll=True)  # I = 2048: 8 down steps per expert


def moe_config(
    num_pairs: int, num_experts: int, itemsize: int = 2, inter: int = 0, tokens: int = 0, hidden: int = 0
) -> MoeConfig:
    """The tiles fused_moe runs by default: the gemv path at tokens = 1 (any I > 0) and at tokens <= 4 where
    I <= 256, else grouped_config's. tokens = 0 (unknown) always gives the grouped path.

    Measured on the H200 (bench/NOTES.md, "Fused MoE, session 3", run 2; graph ms, D = 7168, K = 8, gemv vs
    grouped): E = 256 / I = 256, T = 1 0.036 vs 0.052 (earlier run), T = 2 0.057 vs 0.067, T = 4 0.094 vs
    0.109 (T = 3 not measured: between the two); T = 16 went to grouped before (0.32 vs 0.28, "Fused MoE at
    small T" run 1). E = 32 / I = 2048, T = 1: 0.172 vs 0.189 (T = 2 grouped: 0.310 vs 0.337 then). Session 4
    ("moet1, session 4" run 2): evict_first weight loads at T <= 2, E = 256 T = 1 0.032, T = 2 0.053. hidden: D, for
    grouped_config's short-D tiles (0: unknown, the tiles measured at D = 7168)."""
    grouped = grouped_config(num_pairs, num_experts, itemsize, inter, hidden)
    if tokens == 1 and inter > 256:
        return grouped._replace(gemv=GEMV_WIDE)
    if 1 <= tokens <= 4 and 0 < inter <= 256:
        return grouped._replace(gemv=GEMV_T1 if tokens <= 2 else GEMV_T4)
    return grouped
