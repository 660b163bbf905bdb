"""Fused MoE tiles and the choice among them (kernels/fused_moe.py runs them).

Two paths:
  grouped (any T): align pairs by expert, grouped GEMMs gate_up and down over BLOCK_M blocks, sum over K.
    GemmTile.k_split > 1 (gate_up only) splits K = D over programs that write fp32 partials; the down
    sums them and applies SiLU-and-mul as it loads its A tile (no extra launch).
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
    k_split: int = 0  # gate_up only, > 1: that many programs along K = D, fp32 partials summed by the down


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


class MoeConfig(NamedTuple):
    block_m: int
    gate_up: GemmTile
    down: GemmTile
    gemv: GemvTile | None = None  # set: the align-free decode path (block_m, gate_up, down unused)


def same_tiles(block_m: int, block_n: int, block_k: int, group_m: int, warps: int, stages: int) -> MoeConfig:
    """One tile for both GEMMs (the layout before the GEMMs were tuned apart)."""
    tile = GemmTile(block_n, block_k, group_m, warps, stages)
    return MoeConfig(block_m, tile, tile)


def grouped_config(num_pairs: int, num_experts: int, itemsize: int = 2, inter: int = 0) -> MoeConfig:
    """Grouped-path tiles by the mean rows per expert (H200 sweeps, bench/NOTES.md "Fused MoE" runs 1-2,
    bf16, D = 7168).

    Decode-sized runs (<= 16 rows) want BLOCK_M 16 (the tensor cores' minimum) and many programs
    streaming weights: gate_up (32, 256) 0.033 ms vs (64, 128) 0.040 ms at E = 256, T = 1. From 128
    rows on BLOCK_M 128 beat 64 at both shapes despite more padding (E = 256, T = 4k: 1.26 vs 1.39 ms
    for the two GEMMs); gate_up with gate and up interleaved into one N = 256 product (E = 32, T = 16k:
    13.55 vs 14.20 ms), down with 128 x 256 tiles (7.22 vs 8.37 ms). inter = I <= 256: down holds the
    whole K in one tile and walks N (E = 256: 1.36 vs 1.71 ms at T = 16k, 0.29 vs 0.49 ms at T = 1k).

    fp32 halves BLOCK_K and never takes the whole-K down: the gate_up kernel stages an A tile and two B
    tiles per pipeline stage, and at 4 bytes (16, 64, 128) x 4 stages needs 295 KB of shared memory,
    over the H200's 227 KB (seen on the H200: OutOfResources, required 245760)."""
    rows = num_pairs / max(1, num_experts)
    if rows <= 16:
        bm, up, down, whole_k = 16, GemmTile(32, 256, 1, 4, 3), GemmTile(64, 128, 1, 4, 4), 16
    elif rows <= 64:  # gate_up interleaved measured only at I = 256 (E = 256, T = 1k: 0.50 vs 0.53 ms)
        up = GemmTile(128, 64, 4, 4, 4, True) if 0 < inter <= 256 else GemmTile(64, 128, 4, 4, 4)
        bm, down, whole_k = 32, GemmTile(64, 128, 4, 4, 4), 8
    elif rows < 128:  # not swept at its own T: run 1's BLOCK_M 64 winners
        bm, up, down, whole_k = 64, GemmTile(256, 64, 8, 8, 3), GemmTile(128, 64, 8, 4, 4), 4
    else:
        bm, up, down, whole_k = 128, GemmTile(128, 64, 8, 8, 3, True), GemmTile(256, 64, 8, 8, 3), 4
    if itemsize >= 4:
        up, down = up._replace(block_k=up.block_k // 2), down._replace(block_k=down.block_k // 2)
    elif 0 < inter <= 256:
        down = GemmTile(64, 256, min(8, up.group_m), up.num_warps, 3, n_split=whole_k)
    return MoeConfig(bm, up, down)


DEFAULT_GEMV = GemvTile(8, 512, 4, 16, 256, 4)
GEMV_MAX_TOKENS = 1  # the gemv path up to this many tokens (pairs re-read shared experts past it)


def moe_config(num_pairs: int, num_experts: int, itemsize: int = 2, inter: int = 0, tokens: int = 0) -> MoeConfig:
    """The tiles fused_moe runs by default: the gemv path for 1 <= tokens <= GEMV_MAX_TOKENS, else
    grouped_config's. tokens = 0 (unknown) always gives the grouped path."""
    if 0 < tokens <= GEMV_MAX_TOKENS:
        return grouped_config(num_pairs, num_experts, itemsize, inter)._replace(gemv=DEFAULT_GEMV)
    return grouped_config(num_pairs, num_experts, itemsize, inter)
