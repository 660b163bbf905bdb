"""DpLayout: where every DP rank's tokens sit in the gathered batch of one forward (DP attention).

Under DP attention (ParallelInfo.dp_size P > 1) each DP rank runs attention on its own requests and the MLP
runs over the batch gathered from all P ranks (SGLang's FULL scatter mode; communicator.py). The gathered
batch is laid out in one of two ways, SGLang's DpPaddingMode (python/sglang/srt/layers/dp_attention.py at
00161092):

| mode  | rank d's rows                       | buffer_len   | gather                          | usual in |
| ----- | ----------------------------------- | ------------ | ------------------------------- | -------- |
| "max" | [d * max(counts), + counts[d])      | P * max      | all-gather of [max, D] padded   | decode   |
| "sum" | [sum(counts[:d]), + counts[d])      | sum(counts)  | offset write + all-reduce       | prefill  |

Rows between ranks in "max" mode are padding: they run through the MLP and never reach a request.

`gather_dp_layout` is called on every rank before every forward (a rank with no requests too: it passes 0 and
runs `ForwardBatch.idle`), and its result set as `ForwardBatch.dp_layout`. It is one all-gather of three host
ints per rank over ParallelInfo.cpu_group (gloo), so the counts are on the host with no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from r3trace.capture.recorder import RowRange

from .distributed import all_gather_into
from .parallel import ParallelInfo

DpMode = Literal["max", "sum"]
# Which batch the MoE's router runs over: "gathered", every DP rank's rows (tensor-parallel or replicated
# experts, FULL mode); "local", this DP rank's rows (expert parallelism: SCATTERED over attention-TP, and the
# top-k ids all-gathered back over attention-TP before capture).
MoeBatch = Literal["gathered", "local"]


@dataclass(frozen=True)
class DpLayout:
    counts: tuple[int, ...]  # [P] tokens of every DP rank in this forward
    dp_rank: int
    mode: DpMode
    moe_batch: MoeBatch = "gathered"
    any_replay: bool = False  # some DP rank forces routes this forward: every rank joins the plan's gather

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < len(self.counts):
            raise ValueError(f"dp_rank={self.dp_rank} outside 0..{len(self.counts) - 1} (counts={self.counts})")
        if self.mode not in ("max", "sum"):
            raise ValueError(f"mode={self.mode!r}: expected 'max' or 'sum'")
        if min(self.counts) < 0:
            raise ValueError(f"counts={self.counts}: token counts must be >= 0")

    @property
    def max_len(self) -> int:
        return max(self.counts)

    def start_of(self, dp_rank: int) -> int:
        """First row of dp_rank's tokens in the gathered batch."""
        if self.mode == "max":
            return dp_rank * self.max_len
        return sum(self.counts[:dp_rank])

    @property
    def local_start(self) -> int:
        return self.start_of(self.dp_rank)

    @property
    def local_count(self) -> int:
        return self.counts[self.dp_rank]

    @property
    def buffer_len(self) -> int:
        """Rows of the gathered batch."""
        return len(self.counts) * self.max_len if self.mode == "max" else sum(self.counts)

    @property
    def route_rows(self) -> RowRange:
        """This rank's rows within the batch the router runs over (see MoeBatch)."""
        start = self.local_start if self.moe_batch == "gathered" else 0
        return RowRange(start, self.local_count)


def moe_batch_of(parallel: ParallelInfo) -> MoeBatch:
    """The MoE's batch for a parallel layout: the DP-gathered one unless experts are split over ranks."""
    return "local" if parallel.ep_size > 1 else "gathered"


def gather_dp_layout(local_tokens: int, parallel: ParallelInfo, mode: DpMode, replay: bool = False) -> DpLayout:
    """This forward's DpLayout, the same on every rank. Collective over the whole world: every rank calls it.

    local_tokens: this rank's new tokens (0 for an idle rank); mode: this rank's wish, "sum" for a batch that
    extends, "max" for decode. The layout takes "sum" when any rank wishes it (SGLang: an extend anywhere in
    the batch), so ranks never disagree. replay: this rank's batch has forced routes (ForwardBatch.replay).
    The attention-TP ranks of one DP rank run the same batch: their counts must agree (checked here).
    """
    if mode not in ("max", "sum"):
        raise ValueError(f"mode={mode!r}: expected 'max' or 'sum'")
    mine = torch.tensor([local_tokens, mode == "sum", replay], dtype=torch.int64)
    every = mine
    if parallel.tp_size > 1:
        every = torch.empty(parallel.tp_size * 3, dtype=torch.int64)
        all_gather_into(every, mine, parallel.cpu_group)
    rows = every.view(parallel.dp_size, parallel.attn_tp_size, 3).tolist()  # tp rank = dp rank * A + attn_tp rank
    counts = tuple(group[0][0] for group in rows)
    for d, group in enumerate(rows):
        if any(entry[0] != group[0][0] for entry in group):
            raise RuntimeError(f"DP rank {d}: its attention-TP ranks run different batches ({[e[0] for e in group]})")
    return DpLayout(
        counts=counts,
        dp_rank=parallel.dp_rank,
        mode="sum" if any(e[1] for g in rows for e in g) else "max",
        moe_batch=moe_batch_of(parallel),
        any_replay=any(e[2] for g in rows for e in g),
    )
