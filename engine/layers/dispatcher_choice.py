"""make_dispatcher: the MoE's TokenDispatcher, picked once when the model is built (the table in dispatcher.py).

It sits above both dispatcher modules: dispatcher.py (the protocol, the no-op and DeepEP's normal mode) and
low_latency_dispatcher.py (which imports dispatcher.py's Dispatched) never import it, so the imports run one way.
"""

from __future__ import annotations

from typing import Literal

import torch.distributed as dist

from .dispatcher import AllToAllDispatcher, NullDispatcher, TokenDispatcher
from .low_latency_dispatcher import LowLatencyDispatcher

DispatcherMode = Literal["normal", "low_latency"]


def make_dispatcher(
    num_experts: int,
    ep_rank: int = 0,
    ep_size: int = 1,
    group: dist.ProcessGroup | None = None,
    mode: DispatcherMode = "normal",
    max_tokens: int = 0,
) -> TokenDispatcher:
    """Picked once, when the MoE is built: the NullDispatcher in one process, else DeepEP's normal or low-latency
    mode over group (the expert-parallel group; None: the default group). num_experts: the physical slots P
    (ExpertLocation.num_physical; E without redundant experts). max_tokens: low_latency's per-rank token bound."""
    if mode not in ("normal", "low_latency"):
        raise ValueError(f"mode={mode!r}; expected 'normal' or 'low_latency'")
    if ep_size == 1:
        return NullDispatcher(num_experts)
    if mode == "low_latency":
        return LowLatencyDispatcher(num_experts, ep_rank, ep_size, max_tokens, group)
    return AllToAllDispatcher(num_experts, ep_rank, ep_size, group)
