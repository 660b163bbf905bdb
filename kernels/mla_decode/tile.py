"""How mla_decode's stage 1 is tiled and split: DecodeTile (the knobs bench sweeps), default_decode_tile (the table
of which kernel and tile run by default, the package docstring's), and the split count from lengths and the SM count
(host arithmetic, no device sync: the engine calls it with host-side lengths, once per step or per captured batch
size). Every figure below is an H200, graph-timed decode call, kv_lora 512 + rope 64; BENCHMARKS.md#mla-decode."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from r3trace.kernels.mla_decode.registry import GLUON_KV_LORA, GLUON_ROPE, TMA_PAGE

MIN_TOKENS_PER_SPLIT = 256  # fewer and the split's fixed cost (q load, partial write, merge) dominates
MAX_KV_SPLITS = 64
# Stage-1 programs aimed for by the wave policy: WAVES per SM, rounded up. A 64-key bf16 tile double-buffered is 144 KB
# of shared memory, one program an SM, so with few waves the last one's tail shows: H = 16, B = 64, L = 32k, 5 splits
# (2.4 waves) 0.965 ms, 20 splits (9.7 waves) 0.700 ms. The fp32 H < 64 tile takes 4 waves rounded down (whole_waves):
# at H = 16, B = 64 / 8k, 8 splits (512 programs) 0.176 ms, 9 (a 0.4-wave tail) 0.212.
WAVES = 8
# splits_by_cost's per-program fixed cost in tiles (q load, first tile's latency, partial write), fitted as time ~
# waves x (tiles + F) on the wide Gluon tile (B = 64 / 8k: 1 split 0.414 ms, 9 splits 0.510 -> F = 3.8); with F = 4 the
# model's count was the fastest timed (8 waves up, 4 / 2 / 1 whole waves) at every H = 128 cell.
GLUON_FIXED_TILES = 4
# The H < 64 bf16 Triton tile (16 x 32, 4 warps, 3 stages: 190 registers, 93 KB of shared memory, 2 programs an SM):
# F = 4 picks the fastest measured count at all nine cells (B = 16 / 1k: 8 splits 0.0144 ms vs 0.0189 at the wave
# policy's 4); at least 128 keys a split (16 splits of 64 keys at B = 16 / 1k: 0.0155 ms vs 8 of 128 0.0144).
H16_FIXED_TILES = 4
H16_MIN_SPLIT = 128
# The narrow Gluon tile (16 x 64, one warpgroup, 168 KB: one program an SM): the cost model picks one wave of 128
# programs at all nine cells for any F of 1-8 tiles; two waves were 1.12-1.26x slower at B16/1k, B16/8k, B64/1k.
NARROW_FIXED_TILES = 2
NARROW_MIN_SPLIT = 64
# DecodeTile.cluster: split counts a Gluon kernel can merge inside a thread-block cluster (cluster_merge.py): 8 is the
# portable cluster limit, powers of two so each rank's kv_lora / P output columns are a Gluon shape
CLUSTER_SIZES = (2, 4, 8)
# The narrow default merges 2 splits in clusters of 2: B64/1k 1.07-1.09x over the merge kernel. The wide kernel lost
# even where its clusters fit (4 splits: B8/1k 1.46x slower), so its default keeps the merge kernel (cluster 0).
NARROW_CLUSTER = 2


def choose_num_kv_splits(
    batch: int, num_head_blocks: int, max_seq_len: int, sm_count: int, waves: int = WAVES, whole_waves: bool = False
) -> int:
    """Splits per request so stage 1 has about `waves` programs per SM (at most that many if whole_waves),
    each >= MIN_TOKENS_PER_SPLIT keys. num_head_blocks: stage-1 programs per request and split,
    tile.head_programs(H); DecodeTile.num_kv_splits passes the tile's own waves.

    Pure host arithmetic: the engine calls it with host-side lengths (no device sync) and passes the
    result to mla_decode; under CUDA graphs it passes one fixed value per captured batch size.
    """
    programs = max(1, batch * num_head_blocks)
    by_sms = (waves * sm_count) // programs if whole_waves else triton.cdiv(waves * sm_count, programs)
    by_len = triton.cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT)
    return int(max(1, min(by_sms, by_len, MAX_KV_SPLITS)))


def splits_by_cost(
    batch: int,
    num_head_blocks: int,
    max_seq_len: int,
    sm_count: int,
    block_n: int,
    fixed_tiles: int,
    per_sm: int = 1,
    min_split: int = MIN_TOKENS_PER_SPLIT,
) -> int:
    """Splits per request minimising waves x (tiles per split + fixed_tiles), a wave being per_sm programs on
    every SM: whole waves of long splits, more splits only where they fill SMs left idle (B = 16, H = 128: 32
    programs a split, so 4 splits; B = 48: 96 programs, 4 splits make 2.9 waves and beat both 1 split,
    0.73 of a wave, and 8 waves rounded up). Fewest splits on ties; >= min_split keys each.
    Host arithmetic, no device sync (as choose_num_kv_splits)."""
    programs = max(1, batch * num_head_blocks)
    length = max(1, max_seq_len)
    most = max(1, min(triton.cdiv(length, min_split), MAX_KV_SPLITS))

    def cost(splits: int) -> int:  # the kernel cuts splits at whole tiles: cdiv(cdiv(L, P), block_n) each
        tiles = triton.cdiv(triton.cdiv(length, splits), block_n)
        return triton.cdiv(programs * splits, sm_count * per_sm) * (tiles + fixed_tiles)

    return min(range(1, most + 1), key=cost)


class DecodeTile(NamedTuple):
    """block_h heads x block_n keys per stage-1 program; v_splits 2 gives each half of the c_kv output columns its own
    program (a [block_h, kv_lora / 2] accumulator; both recompute the scores); keys_major computes scores as [keys,
    heads] (the kv tile as the product's M side); kernel names the stage-1 record (registry.py): "triton", or a Gluon
    kernel written for one tile ("wide", "seesaw": 64 x 64 x 8 warps; "narrow": 16 x 64 x 4 warps; 2 stages)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    v_splits: int = 1
    keys_major: bool = False
    kernel: str = "triton"
    waves: int = WAVES  # stage-1 programs per SM the split count aims for (choose_num_kv_splits)
    whole_waves: bool = False  # round the split count down (no partial last wave), not up
    fixed_tiles: int = 0  # > 0: split count by splits_by_cost with this per-program cost in tiles, not waves
    per_sm: int = 1  # programs resident per SM (registers, shared memory): a wave for splits_by_cost
    min_split: int = MIN_TOKENS_PER_SPLIT  # fewest keys a split gets (splits_by_cost)
    # one split: stage 1 writes the output, no merge launch. The Gluon tiles' default (H = 128, B >= 64: 1.01-1.10x);
    # the H = 16 Triton tile was 2% slower with it at B = 256 / 1k, so it keeps the merge
    direct: bool = False
    # the caller's KV pages (slots in runs of page_size): a multiple of 64 lets the Gluon kernel load a tile
    # as TMA boxes (latent_tiles.tma_usable), else row by row; the Triton kernel ignores it
    page_size: int = 1
    # Programmatic dependent launch (sm_90+, every stage 1 and the merge): each kernel is launched while the one
    # before it still runs and waits (griddepcontrol.wait) before it touches q, the cache or the partials, so its
    # launch and block scheduling overlap the previous kernel's tail; graph-capturable. The Gluon stage 1s read the
    # index tables (seq_lens, req_pool_indices, req_to_token) before the wait, and the narrow one's TMA form a split's
    # first tile unless it holds the request's last position (B64/1k 1.05x, B16/1k 1.06x), so the kernel launched just
    # before the call may write q and each request's newest cache row (seq_len - 1: the decode step's latent write),
    # nothing else the call reads (the engine writes the tables by copies and one scatter at the start of a step, many
    # kernels before any attention). Speculative decoding that writes several new rows a request must revisit this.
    pdl: bool = False
    # the Gluon kernels only: a split count in CLUSTER_SIZES up to this runs each (request, head block)'s splits
    # as one thread-block cluster that merges in distributed shared memory and stores the output (no fp32 partials,
    # no merge launch); other split counts (and 0) take the merge kernel
    cluster: int = 0
    # the wide Gluon kernel's schedule switches (constexprs of wide.py's kernel; the others ignore them): the row max
    # swapped through shared memory (max_xchg), the cp.async gather issued under the score wgmmas (gather_under_s),
    # the output stored through shared memory as 16-byte rows (coalesced_out). Each on by default; off only to time
    # the alternative (bench/mla_decode_h128.py --variants); wide.py gives each one's figure.
    max_xchg: bool = True
    gather_under_s: bool = True
    coalesced_out: bool = True

    def head_programs(self, num_heads: int) -> int:
        """Stage-1 programs per (request, split): head blocks x value splits."""
        return triton.cdiv(num_heads, self.block_h) * self.v_splits

    def num_kv_splits(self, batch: int, num_heads: int, max_seq_len: int, sm_count: int) -> int:
        """splits_by_cost (fixed_tiles > 0) or choose_num_kv_splits for this tile's programs and waves (host
        arithmetic, no device sync)."""
        if self.fixed_tiles > 0:
            return splits_by_cost(
                batch, self.head_programs(num_heads), max_seq_len, sm_count, self.block_n, self.fixed_tiles,
                self.per_sm, self.min_split,
            )  # fmt: skip
        return choose_num_kv_splits(
            batch, self.head_programs(num_heads), max_seq_len, sm_count, self.waves, self.whole_waves
        )


def default_decode_tile(
    num_heads: int,
    dtype: torch.dtype,
    use_gluon: bool = False,
    kv_lora: int = 512,
    rope: int = 64,
    page_size: int = 1,
) -> DecodeTile:
    """The tile (and with it the stage-1 record) that runs by default; use_gluon: the caller is on a Hopper GPU.

    H >= 64 with use_gluon and a Gluon shape (bf16/fp16, kv_lora in GLUON_KV_LORA, rope in GLUON_ROPE): a 64 x 64
    Gluon tile, its split count by cost, one split written directly; the seesaw kernel on pages of a multiple of 64
    slots at rope 64 (1.08-1.10x the wide one at kv_len >= 8k), else the wide one (B = 256 / 32k: 6.86 vs 9.47 ms for
    the best Triton tile). H < 64 with use_gluon, a Gluon shape and such pages: the narrow Gluon tile in its TMA form
    (1.10-1.18x the Triton tile at all nine cells), PDL, 2 splits merged in a cluster; its cp.async form only ties the
    Triton tile, so other page sizes keep that. Otherwise Triton: 64 x 64 over 8 warps at H >= 64 (the best of 13
    Triton tiles; fp32 halves the keys so two fp32 tiles fit in shared memory); 16 x 32 over 4 warps below, 3 stages
    and splits by cost over 2 programs an SM with PDL in bf16/fp16, 2 stages and 4 whole waves in fp32. page_size (the
    KV pool's) goes to the Gluon tiles only. Figures: BENCHMARKS.md#mla-decode."""
    gluon_shape = use_gluon and dtype.itemsize == 2 and kv_lora in GLUON_KV_LORA and rope in GLUON_ROPE
    if num_heads >= 64:
        if gluon_shape:
            seesaw = page_size % TMA_PAGE == 0 and rope == 64
            return DecodeTile(64, 64, 8, 2, kernel="seesaw" if seesaw else "wide", fixed_tiles=GLUON_FIXED_TILES,
                              direct=True, page_size=page_size)  # fmt: skip
        return DecodeTile(64, 64 if dtype.itemsize <= 2 else 32, 8, 2)
    if gluon_shape and page_size % TMA_PAGE == 0:  # the TMA form; its cp.async form only ties the Triton tile
        return DecodeTile(16, 64, 4, 2, kernel="narrow", fixed_tiles=NARROW_FIXED_TILES, min_split=NARROW_MIN_SPLIT,
                          direct=True, page_size=page_size, pdl=True, cluster=NARROW_CLUSTER)  # fmt: skip
    if dtype.itemsize <= 2:
        return DecodeTile(16, 32, 4, 3, fixed_tiles=H16_FIXED_TILES, per_sm=2, min_split=H16_MIN_SPLIT, pdl=True)
    return DecodeTile(16, 32, 4, 2, waves=4, whole_waves=True)
