"""ParallelInfo: ranks, sizes and process groups as one frozen object handed to constructors.

One process is the default (every size 1, no groups, no torch.distributed). The process count is tp_size,
as in SGLang; every other rank is derived from tp_rank the way SGLang derives it:

| quantity     | formula                          | group: the ranks that share ...           |
| ------------ | -------------------------------- | ----------------------------------------- |
| attn_tp_size | tp_size // dp_size               | attn_dp_rank (a contiguous block)         |
| attn_tp_rank | tp_rank % attn_tp_size           |                                           |
| attn_dp_rank | tp_rank // attn_tp_size          | dp group: attn_tp_rank (stride attn_tp)   |
| moe_tp_size  | tp_size // ep_size               |                                           |
| ep_rank      | tp_rank // moe_tp_size           | ep group: tp_rank % moe_tp_size (stride)  |

Model math never reads a rank: constructors turn this object into shard sizes and offsets (linear.py), and
collectives happen only in the communicators (communicator.py). distributed.py builds the groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParallelInfo:
    tp_rank: int = 0
    tp_size: int = 1
    dp_size: int = 1  # DP attention: attention data-parallel, MoE over the gathered batch
    ep_size: int = 1
    # torch.distributed ProcessGroups (None in one process); excluded from ==, so infos compare by layout.
    tp_group: Any = field(default=None, compare=False, repr=False)
    attn_tp_group: Any = field(default=None, compare=False, repr=False)
    dp_group: Any = field(default=None, compare=False, repr=False)
    ep_group: Any = field(default=None, compare=False, repr=False)
    # gloo over the whole world, for host ints (DpLayout's token counts): they never go through NCCL, whose
    # collectives would need a device tensor and a host sync to read them back.
    cpu_group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size", "ep_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} outside 0..{self.tp_size - 1} (tp_size={self.tp_size})")
        for name in ("dp_size", "ep_size"):
            if self.tp_size % getattr(self, name):
                raise ValueError(f"{name}={getattr(self, name)} must divide tp_size={self.tp_size}")

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.tp_rank % self.attn_tp_size

    @property
    def attn_dp_rank(self) -> int:
        return self.tp_rank // self.attn_tp_size

    @property
    def dp_rank(self) -> int:
        """The DP attention rank (SGLang's attn_dp_rank)."""
        return self.attn_dp_rank

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    @property
    def is_single(self) -> bool:
        return self.tp_size == 1 and self.dp_size == 1 and self.ep_size == 1


def group_ranks(tp_size: int, dp_size: int, ep_size: int) -> dict[str, list[list[int]]]:
    """Every group's ranks, in creation order: {"tp" | "attn_tp" | "dp" | "ep": [ranks of each group]}.

    Pure (no torch.distributed): init_parallel creates them in this order on every rank, and the tests
    check it against SGLang's formulas.
    """
    layout = ParallelInfo(0, tp_size, dp_size, ep_size)
    attn_tp, moe_tp = layout.attn_tp_size, layout.moe_tp_size
    return {
        "tp": [list(range(tp_size))],
        "attn_tp": [list(range(d * attn_tp, (d + 1) * attn_tp)) for d in range(dp_size)],
        "dp": [list(range(a, tp_size, attn_tp)) for a in range(attn_tp)],
        "ep": [list(range(m, tp_size, moe_tp)) for m in range(moe_tp)],
    }
