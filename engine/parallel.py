"""ParallelInfo: rank, sizes and groups as one frozen object handed to constructors.

One process is the default (every size 1). Tensor parallelism, DP attention and expert parallelism
plug in through LayerCommunicator and the MoE dispatcher, reading only this object.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelInfo:
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1  # DP attention: attention data-parallel, MoE over the gathered batch
    ep_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        for rank, size in (("tp_rank", "tp_size"), ("dp_rank", "dp_size"), ("ep_rank", "ep_size")):
            r, s = getattr(self, rank), getattr(self, size)
            if s < 1 or not 0 <= r < s:
                raise ValueError(f"{rank}={r} outside 0..{s - 1} ({size}={s})")

    @property
    def is_single(self) -> bool:
        return self.tp_size == 1 and self.dp_size == 1 and self.ep_size == 1
