"""MLA attention for short extends (a speculative verify's d + 1 rows, a short chunk) in the default mode:
token_block.py's stage 1 with splits cut per block on the device, and fixed_split.py's ordered merge.

Shape legend as in decode.py: T query rows, B requests (each a run of consecutive rows of T), H heads,
C = kv_lora + rope, P splits.

Why the split size is cut on the device: the host knows only bounds on the lengths (a CUDA graph's are the longest
context it holds), so splits sized from them put a request's few hundred keys in one split and one program walks
them all, a key tile after another: 33 us at batch 1 for 260 keys at H = 16 (H200,
bench/results/short_extend-h200.json).
The host picks the split count P for its bound by a cost model in key-tile times (split_cost: waves x (FIXED_TILES +
tiles a split) + splits x rows x heads x PART_COST), and each block cuts its own longest row into P runs of whole
tiles, at least min_split keys each, on the device. The model was fitted to 18 cells x 4 split rules of that file
(a program walks a tile in ~4.4 us, a split costs ~2.5 tiles more for its query load, partial write and merge, and
the fp32 partials cost bandwidth at many rows); its P at the bound, cut at the real length, is the model's best at
the real length in all 24 cells of H 16 / 128, batch 1-64, 260-4,100 keys. Choosing P per block on the device
instead cost more than it saved: a grid of 16 splits, most of whose programs exit at once, still holds an SM each
(233 against 98 us at H = 128, batch 32). A row's bits follow its block's split size, hence the batch: this is the
default mode's path, not batch_invariant's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from r3trace.kernels.contract import require
from r3trace.kernels.mla_decode.fixed_split import check_block_args, split_attention
from r3trace.kernels.mla_decode.token_block import TokenBlockTile

FIXED_TILES = 2.5  # a split's fixed cost (query load, partial write, its share of the merge) in key-tile times
PART_COST = 1e-4  # key-tile times a (row, head, split) partial costs in bandwidth (2 KB written, then read)


def split_cost(keys: int, splits: int, programs: int, sm_count: int, row_heads: int, min_split: int,
               block_n: int) -> float:  # fmt: skip
    """Modelled time, in key-tile times, of `programs` blocks of `keys` keys each cut into `splits` runs (as the
    device cuts them) over sm_count SMs, one program an SM; row_heads: the launch's rows x heads."""
    size = triton.cdiv(max(triton.cdiv(keys, splits), min_split), block_n) * block_n
    n = triton.cdiv(keys, size)
    return triton.cdiv(programs * n, sm_count) * (FIXED_TILES + size // block_n) + n * row_heads * PART_COST


@dataclass(frozen=True)
class ShortExtendDecoder:
    """tile: token_block_tile's for the heads and dtype; min_split: the fewest keys a split gets (a multiple of the
    tile's keys); max_splits: the most splits a block gets (its fp32 partials are T x H x P x kv_lora); sm_count:
    the device's, for the cost model's waves."""

    tile: TokenBlockTile
    min_split: int
    max_splits: int
    sm_count: int

    def num_splits(self, batch: int, num_heads: int, max_q_len: int, max_seq_len: int, rows: int) -> int:
        """P from host bounds: the least split_cost at max_seq_len keys (the fewest P on a tie) for batch requests
        of up to max_q_len rows, `rows` rows in all."""
        t = self.tile
        programs = batch * triton.cdiv(num_heads, t.heads) * triton.cdiv(max(1, max_q_len), t.tokens)
        return least_splits(max(1, max_seq_len), programs, self.sm_count, rows * num_heads, self.min_split, t.block_n,
                            self.max_splits)  # fmt: skip


    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        q_start: torch.Tensor,
        q_lens: torch.Tensor,
        row_keys: torch.Tensor,
        kv_lora_rank: int,
        sm_scale: float,
        num_splits: int,
        max_q_len: int,
    ) -> torch.Tensor:
        """q [T, H, C] -> [T, H, kv_lora], arguments as FixedSplitDecoder's; num_splits: P (num_splits()), max_q_len:
        a host bound on q_lens (the grid's rows only)."""
        check_block_args(q, kv_cache, req_to_token, req_pool_indices, q_start, q_lens, row_keys, kv_lora_rank)
        require(self.min_split % self.tile.block_n == 0,
                f"min_split {self.min_split} is not a multiple of the tile's {self.tile.block_n} keys")  # fmt: skip
        require(num_splits >= 1, f"num_splits {num_splits} is below 1")
        T, H, _ = q.shape
        out = torch.empty((T, H, kv_lora_rank), dtype=q.dtype, device=q.device)
        if T == 0 or H == 0:
            return out
        split_attention(q, kv_cache, req_to_token, req_pool_indices, q_start, q_lens, row_keys, kv_lora_rank,
                        sm_scale, self.tile, self.min_split, num_splits, max_q_len, out, dynamic=True)  # fmt: skip
        return out


# every layer of a forward asks with the same arguments: the 16 cost evaluations took 0.11 ms of host time a call
# on the 2-core CI machine, 4 us cached (eager short extends ask once a layer)
@functools.lru_cache(maxsize=256)
def least_splits(keys: int, programs: int, sm_count: int, row_heads: int, min_split: int, block_n: int,
                 most: int) -> int:  # fmt: skip
    """The fewest of 1 .. most splits at the least split_cost."""
    costs = [split_cost(keys, p, programs, sm_count, row_heads, min_split, block_n) for p in range(1, most + 1)]
    return 1 + costs.index(min(costs))
