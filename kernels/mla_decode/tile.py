"""How mla_decode's stage 1 is tiled and split: DecodeTile (the knobs bench sweeps), the default per head count
and dtype (what the H200 sweeps picked), and the split count from lengths and the SM count (host arithmetic,
no device sync: the engine calls it with host-side lengths, once per step or per captured batch size)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from r3trace.kernels.mla_decode.registry import GLUON_KV_LORA, GLUON_ROPE, TMA_PAGE

MIN_TOKENS_PER_SPLIT = 256  # fewer and the split's fixed cost (q load, partial write, merge) dominates
MAX_KV_SPLITS = 64
# Stage-1 programs aimed for: WAVES per SM. A 64-key bf16 tile double-buffered is 144 KB of shared
# memory, so one program per SM: with few waves the last one's tail shows. H200, H=16, B=64, L=32k:
# 5 splits (2.4 waves) 0.965 ms, 20 splits (9.7 waves) 0.700 ms (bench/NOTES.md, run 2).
WAVES = 8
# Session 3 (graph-timed, bench/NOTES.md "MLA decode, session 3", run 4): at H = 16 fewer, longer splits
# win, but only if they fill whole waves: B = 64 / 8k, 16x32x4w,3st: 8 splits (512 programs) 0.176 ms, 9
# (576: a 0.4 wave tail) 0.212, 17 0.193. So the H < 64 tile asked for 4 programs per SM rounded down
# (whole_waves; the H < 64 fp32 tile still does; bf16 moved to splits_by_cost in session 4, below); at H >= 64
# (one program per SM, compute-bound) 8 waves rounded up, as measured.
# Session 3b (run 6, Gluon 64 x 64 tile, graph-timed): fewer, longer splits win at every H = 128 cell, as long
# as the waves stay whole: B = 64 / 8k, 1 split (128 programs, 1 wave of 128 tiles) 0.414 ms, 2 0.428, 4 0.454,
# 9 (the 8-wave default) 0.510. A program's fixed cost F (q load 72 KB, first tile's latency, 128 KB partial
# write) in tiles, fitted as time ~ waves x (tiles + F): 128 + 9F = 1.232 (128 + F) -> F = 3.8, which then
# predicts 4 splits 0.450 and 2 splits 0.426. splits_by_cost minimises that model.
# Session 4 (bench/NOTES.md, "mla128, session 4", runs 1-4; the kernel 1.06-1.13x faster, 4 barriers a tile):
# the policy's split count was still the fastest of those timed (8 waves up, 4 / 2 / 1 whole waves) at all
# ten cells in every run, so F = 4 stays.
GLUON_FIXED_TILES = 4
# Session 4 (mla16 run 1, graph-timed, caches rotated past L2): the H < 64 bf16 tile (16 x 32 x 4 warps, 3 stages)
# compiles to 190 registers and 93 KB of shared memory (triton 3.6, sm_90): 2 programs per SM. Under that wave,
# splits_by_cost with F = 4 tiles picked the fastest split count measured at all nine cells (B = 16: 8 / 16 / 16
# at 1k / 8k / 32k, B = 64: 4, B = 256: 1), e.g. B = 16 / 1k 0.0144 ms at 8 splits vs 0.0189 at the 4 of 4
# programs per SM rounded down, B = 256 / 1k 0.0893 at 1 vs 0.1006 at 2. min_split 128 keys (4 tiles):
# 16 splits of 64 keys at B = 16 / 1k took 0.0155 ms, 8 of 128 0.0144, though the model prefers 16.
H16_FIXED_TILES = 4
H16_MIN_SPLIT = 128
# Session 7 (bench/NOTES.md "Session 7", run 2): the narrow Gluon tile (16 heads x 64 keys, one warpgroup, 168 KB
# of shared memory: one program an SM). splits_by_cost picks one wave of 128 programs at all nine cells for any
# fixed cost of 1-8 tiles (8 splits at B = 16, 2 at 64, 1 at 256); doubling them (2 waves) was 1.12-1.26x slower
# at B16/1k, B16/8k and B64/1k.
NARROW_FIXED_TILES = 2
NARROW_MIN_SPLIT = 64
# DecodeTile.cluster: split counts the narrow kernel can merge inside a thread-block cluster (cluster_merge.py): 8 is
# the portable cluster limit, powers of two so each rank's kv_lora / P output columns are a Gluon shape
CLUSTER_SIZES = (2, 4, 8)
# Session 8 (bench/NOTES.md "Session 8", runs 1-7, graph-timed): the narrow kernel's 2 splits merged in clusters of 2
# took B64/1k from 0.0259-0.0265 ms to 0.0238-0.0250 (1.07-1.09x), B64/8k 1.02-1.03x, B64/32k 1.01x. Clusters that
# do not all fit at once (on the H200 66 of 2, 30 of 4, 15 of 8 at one CTA an SM) come in a second wave, 1.3-2.2x
# slower, so the launcher declines those (cluster_merge.launch_in_clusters). The wide kernel lost even where its
# clusters fit (4 splits: B8/1k 1.46x, B15/8k 1.09x slower): its default keeps the merge kernel (cluster 0).
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
    """block_h heads x block_n keys per stage-1 program; v_splits 2 gives each half of the c_kv output
    columns its own program (a [block_h, kv_lora / 2] accumulator; both recompute the scores);
    keys_major computes scores as [keys, heads] (kv tile as the product's M side); kernel "gluon" runs
    stage 1 as mla_decode_gluon.py's two-warpgroup kernel (64 x 64 x 8 warps, 2 stages only)."""

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
    direct: bool = False  # one split: stage 1 writes the output, no merge launch (the Gluon tile's default)
    # the caller's KV pages (slots in runs of page_size): a multiple of 64 lets the Gluon kernel load a tile
    # as TMA boxes (mla_decode_gluon.tma_usable), else row by row; the Triton kernel ignores it
    page_size: int = 1
    # Programmatic dependent launch (sm_90+, every stage 1 and the merge): each kernel is launched while the one
    # before it still runs and waits (griddepcontrol.wait) before it touches q, the cache or the partials, so its
    # launch and block scheduling overlap the previous kernel's tail; graph-capturable. The Gluon stage 1s read the
    # index tables (seq_lens, req_pool_indices, req_to_token) before the wait (session 9: B64/1k 1.025x, B16/1k
    # 1.05x), and the narrow one's TMA form a split's first tile unless it holds the request's last position
    # (run 9: B64/1k 1.05x more, B16/1k 1.06x), so the kernel launched just before the call may write q and each
    # request's newest cache row (seq_len - 1: the decode step's latent write), nothing else the call reads (the
    # engine writes the tables by copies and one scatter at the start of a step, many kernels before any
    # attention). Speculative decoding that writes several new rows a request must revisit the latter.
    pdl: bool = False
    # the Gluon kernels only: a split count in CLUSTER_SIZES up to this runs each (request, head block)'s splits
    # as one thread-block cluster that merges in distributed shared memory and stores the output (no fp32 partials,
    # no merge launch); other split counts (and 0) take the merge kernel
    cluster: int = 0
    # the wide Gluon kernel's schedule switches (constexprs of wide.py's kernel; the others ignore them): the row max
    # swapped through shared memory (max_xchg), the cp.async gather issued under the score wgmmas (gather_under_s),
    # the output stored through shared memory as 16-byte rows (coalesced_out). Each on by default; off only to time
    # the alternative (bench/mla_decode_h128.py --variants).
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
    """The tile the H200 sweeps picked (BENCHMARKS.md, "### MLA decode"). H < 64: 16 heads x 32 keys, 3
    stages (B = 64, L = 8k graph-timed: 0.176 ms vs 0.192 for 16 x 64 x 2 stages at 8 waves rounded up); bf16
    splits by splits_by_cost over 2 programs per SM (session 4: 1.03-1.32x at seven of the nine cells, a tie
    at B = 64 / 1k and 32k), fp32 4 programs per SM rounded down; bf16 launches both kernels as programmatic
    dependents (pdl; session 5: 0.6-1.4 us a call faster at the 19-151 MB cells, bench/NOTES.md "mla16b, session 5").
    H < 64, use_gluon, a shape the Gluon kernels take and pages of a multiple of 64 slots: the narrow Gluon tile in
    its TMA form (mla_decode_narrow.py; session 7 run 5, graph-timed on shuffled 64-slot pages: 1.10-1.18x the
    Triton tile at all nine cells, 82% of copy at B16/8k, 93-108% at the >= 300 MB cells), one wave of programs,
    stage 1 and the merge launched as programmatic dependents, one split written directly, two merged inside a
    cluster of 2 (cluster_merge.py; session 8: B64/1k 1.07-1.09x, B64/8k 1.03x). Its cp.async form (other
    page sizes) was 0.88-1.04x the Triton tile (run 3; B16/1k 0.88x), so smaller pages keep the Triton tile.
    H >= 64: use_gluon (the caller is on a Hopper GPU) and a shape the Gluon kernel takes: its two-warpgroup
    64 x 64 tile (B = 256, L = 32k: 6.86 vs 9.47 ms; the seesaw schedule, mla_decode_seesaw.py, on pages of a
    multiple of 64 slots at rope 64), its split count by splits_by_cost (run 6: 1.03-1.28x
    over 8 waves rounded up at kv_len >= 8k), and with one split stage 1 writes the output (direct: 1.01-1.10x at
    B >= 64, no merge launch; at H = 16 it was 2% slower at B = 256 / 1k, so the Triton tiles keep the merge:
    bench/NOTES.md "Engine owner, session 4"); else Triton's 64 heads x 64 keys over 8 warps (the best
    of 13 Triton tiles incl. value splits, 128 heads, keys-major scores, two programs per SM). fp32 halves
    the keys so two fp32 tiles still fit in shared memory. page_size (the KV pool's) goes to the Gluon tile only."""
    gluon_shape = use_gluon and dtype.itemsize == 2 and kv_lora in GLUON_KV_LORA and rope in GLUON_ROPE
    if num_heads >= 64:
        if gluon_shape:
            # pages of a multiple of 64 slots and rope 64: the seesaw kernel (mla_decode_seesaw.py; session 11,
            # graph-timed beside the wide kernel: 1.08-1.10x at kv_len >= 8k, 1.03x / 1.05x at B64/1k / B256/1k,
            # 0.965x at B16/1k), at the wide kernel's split counts; else the wide kernel (its cp.async form)
            seesaw = page_size % TMA_PAGE == 0 and rope == 64
            return DecodeTile(64, 64, 8, 2, kernel="seesaw" if seesaw else "wide", fixed_tiles=GLUON_FIXED_TILES,
                              direct=True, page_size=page_size)  # fmt: skip
        return DecodeTile(64, 64 if dtype.itemsize <= 2 else 32, 8, 2)
    if gluon_shape and page_size % TMA_PAGE == 0:  # the TMA form; its cp.async form only ties the Triton tile (run 3)
        return DecodeTile(16, 64, 4, 2, kernel="narrow", fixed_tiles=NARROW_FIXED_TILES, min_split=NARROW_MIN_SPLIT,
                          direct=True, page_size=page_size, pdl=True, cluster=NARROW_CLUSTER)  # fmt: skip
    if dtype.itemsize <= 2:
        return DecodeTile(16, 32, 4, 3, fixed_tiles=H16_FIXED_TILES, per_sm=2, min_split=H16_MIN_SPLIT, pdl=True)
    return DecodeTile(16, 32, 4, 2, waves=4, whole_waves=True)
