"""init_parallel: the process groups of one rank, built once over an initialized default group; all_gather_into:
the one flat all-gather every caller goes through, whatever torch's name for it.

The caller (a launcher, torchrun, a test) has run torch.distributed.init_process_group with world size
tp_size; gloo on CPU and NCCL on CUDA go through this same code. One more group, cpu_group, is gloo over the
whole world whatever the backend: DpLayout's host token counts travel there (dp_layout.py). dist.new_group must
be entered by every rank for every group, in the same order, even for groups the rank is not in: group_ranks
fixes that order.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .parallel import ParallelInfo, group_ranks


def init_parallel(
    tp_size: int,
    dp_size: int = 1,
    ep_size: int = 1,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> ParallelInfo:
    """-> this rank's ParallelInfo with its tp, attention-TP, dp and ep groups. backend: None = the default
    group's (gloo or nccl); timeout: of the subgroups' collectives (None = torch's backend default, 30 min
    for gloo, whatever the default group was given)."""
    if not dist.is_initialized():
        raise RuntimeError("init_parallel needs torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp_size:
        raise ValueError(f"tp_size={tp_size} but the world has {world} processes (one process per TP rank)")
    groups: dict[str, Any] = {}
    for kind, all_ranks in group_ranks(tp_size, dp_size, ep_size).items():
        for ranks in all_ranks:
            group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                groups[kind] = group
    cpu_group = dist.new_group(ranks=list(range(world)), backend="gloo", timeout=timeout)  # host ints (dp_layout.py)
    return ParallelInfo(
        tp_rank=rank, tp_size=tp_size, dp_size=dp_size, ep_size=ep_size, tp_group=groups["tp"],
        attn_tp_group=groups["attn_tp"], dp_group=groups["dp"], ep_group=groups["ep"], cpu_group=cpu_group,
    )


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    """x [n, ...] on every rank of group -> out [size * n, ...] in group rank order. torch 2.13 calls it
    all_gather_single and has all_gather_into_tensor warn a FutureWarning a call; torch 2.11 (the lent GPU
    machine's) has only all_gather_into_tensor, and pyproject allows torch >= 2.4. Looked up when called, so a
    wrapper installed on torch.distributed (bench/collective_bytes.py's counters) sees the call."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)
