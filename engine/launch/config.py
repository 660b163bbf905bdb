"""LaunchConfig: how many processes an engine runs and how the front end spreads requests over them.

The process count is tp_size, as in SGLang; dp_size > 1 is DP attention (SGLang's --enable-dp-attention:
each of the dp_size groups of tp_size // dp_size ranks owns a scheduler, a KV pool and a prefix cache);
ep_size > 1 runs the MoE expert-parallel. engine/parallel.py derives every rank from these three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from r3trace.engine.engine_config import EngineConfigError
from r3trace.engine.parallel import ParallelInfo

LoadBalanceMethod = Literal["round_robin", "shortest_queue"]  # SGLang's names
LOAD_BALANCE_METHODS: tuple[LoadBalanceMethod, ...] = ("round_robin", "shortest_queue")
# spawn: the engine's process spawns every rank. torchrun: torchrun started them (env:// rendezvous); the
# engine is built on world rank 0, whose rank loop then runs in a thread beside it (engine/launch/__main__.py).
Launcher = Literal["spawn", "torchrun"]


@dataclass(frozen=True)
class LaunchConfig:
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    load_balance_method: LoadBalanceMethod = "round_robin"
    # Every collective of a rank gives up after this long, so a rank whose peer died (or hangs) fails instead of
    # waiting for gloo's 30-minute default; the front end's watchdog notices a dead process sooner still.
    collective_timeout_s: float = 120.0
    launcher: Launcher = "spawn"

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(f"{name}={value!r} must be an integer >= 1")
        for name in ("dp_size", "ep_size"):
            if self.tp_size % getattr(self, name):
                raise EngineConfigError(f"{name}={getattr(self, name)} must divide tp_size={self.tp_size}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise EngineConfigError(
                f"load_balance_method={self.load_balance_method!r} must be one of {list(LOAD_BALANCE_METHODS)}"
            )
        if self.launcher not in ("spawn", "torchrun"):
            raise EngineConfigError(f"launcher={self.launcher!r} must be 'spawn' or 'torchrun'")
        if not self.collective_timeout_s > 0:
            raise EngineConfigError(f"collective_timeout_s={self.collective_timeout_s} must be > 0")

    @property
    def multi_process(self) -> bool:
        return self.tp_size > 1

    def parallel_info(self, rank: int) -> ParallelInfo:
        """The layout of one rank, without groups (the front end and the tests use it)."""
        return ParallelInfo(rank, self.tp_size, self.dp_size, self.ep_size)

    def reporting_ranks(self) -> list[int]:
        """Attention-TP rank 0 of each DP group: the ranks that send results and trace rows to the front end."""
        attn_tp = self.tp_size // self.dp_size
        return [d * attn_tp for d in range(self.dp_size)]

    def manifest(self) -> dict[str, int]:
        """The trace manifest's `parallel` field."""
        return {"tp_size": self.tp_size, "dp_size": self.dp_size, "ep_size": self.ep_size}
