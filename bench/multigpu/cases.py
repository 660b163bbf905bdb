"""The parallel matrix: which layouts run, in which mode, with which expert placement, and what each needs.

| case                     | GPUs | what it checks                                                              |
| ------------------------ | ---- | --------------------------------------------------------------------------- |
| exact/tpG                | G    | tensor parallelism: exact all-reduce of o_proj, dense MLP, MoE partials     |
| exact/dpG                | G    | DP attention (MoE tensor-parallel over the gathered batch); idle DP ranks   |
| exact/epG                | G    | expert parallelism (attention TP G): the low-latency dispatch and combine  |
| exact/dpG_epG            | G    | DP attention + expert parallelism: each rank's own rows scattered          |
| exact/tpG_dpG/2[_epG]    | G>=4 | attention TP 2 inside each DP group (routes all-gathered over it)          |
| exact/epG+static+rebalance | G  | 8 redundant experts, static replica choice, a rebalance while requests run |
| exact/dpG_epG+dynamic    | G    | 8 redundant experts, dynamic replica choice per token, under DP attention  |
| default/tpG, dpG, epG, dpG_epG | G | default mode: routes equal away from near-ties, near-tie flips counted   |

G is 2, 4 and 8. Every exact case runs the whole workload (workload.py: spread, idle DP rank, prefix hits,
an idle rank mid-stream, replay, preemption) against the one-process exact run, a trace recording throughout; the
placement cases also check the physical ids returned. A case that cannot run says why (`refusal`): more GPUs than
there are, or an attention-TP size the model's heads do not divide. Nothing is skipped silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from bench.multigpu.placement import REDUNDANT

Mode = Literal["exact", "default"]
Dispatch = Literal["none", "static", "dynamic"]
WORLDS = (2, 4, 8)


@dataclass(frozen=True)
class Layout:
    """tp: the process count (SGLang's); dp > 1: DP attention; ep > 1: expert parallelism (both divide tp)."""

    tp: int
    dp: int = 1
    ep: int = 1

    @property
    def name(self) -> str:
        """tpG, dpG, epG (attention TP G, MoE EP G: SGLang's --tp G --ep G), dpG_epG; otherwise every size > 1."""
        short = {(1, 1): f"tp{self.tp}", (self.tp, 1): f"dp{self.tp}", (1, self.tp): f"ep{self.tp}",
                 (self.tp, self.tp): f"dp{self.tp}_ep{self.tp}"}  # fmt: skip
        if (self.dp, self.ep) in short:
            return short[(self.dp, self.ep)]
        return f"tp{self.tp}" + (f"_dp{self.dp}" if self.dp > 1 else "") + (f"_ep{self.ep}" if self.ep > 1 else "")

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp

    def engine_kwargs(self) -> dict[str, int]:
        return {"tp_size": self.tp, "dp_size": self.dp, "ep_size": self.ep}


@dataclass(frozen=True)
class Case:
    layout: Layout
    mode: Mode
    dispatch: Dispatch = "none"  # with redundant experts: which replica a routed pair goes to
    rebalance: bool = False

    @property
    def name(self) -> str:
        extra = "" if self.dispatch == "none" else f"+{self.dispatch}"
        return f"{self.mode}/{self.layout.name}{extra}{'+rebalance' if self.rebalance else ''}"

    @property
    def gpus(self) -> int:
        return self.layout.tp

    def engine_options(self) -> dict[str, Any]:
        """EngineConfig options beyond the workload's (OPTIONS) and the device's."""
        if self.dispatch == "none":
            return {}
        return {"ep_num_redundant_experts": REDUNDANT, "ep_dispatch_algorithm": self.dispatch,
                "capture_physical_ids": True, "expert_dispatch_seed": 3}  # fmt: skip

    def refusal(self, world: int, num_heads: int) -> str | None:
        """Why this case cannot run with `world` GPUs on a model of num_heads attention heads; None: it can."""
        if self.gpus > world:
            return f"needs {self.gpus} GPUs"
        if num_heads % self.layout.attn_tp:
            return (f"the model has {num_heads} attention heads: attention TP {self.layout.attn_tp} needs a multiple "
                    f"of {self.layout.attn_tp}")  # fmt: skip
        return None


def layouts(g: int) -> list[Layout]:
    """The plain layouts of g GPUs: TP, DP attention, EP, DP + EP, and from 4 GPUs attention TP 2 inside DP."""
    out = [Layout(g), Layout(g, g), Layout(g, 1, g), Layout(g, g, g)]
    return out + ([Layout(g, g // 2), Layout(g, g // 2, g)] if g >= 4 else [])


def matrix(worlds: tuple[int, ...] = WORLDS) -> list[Case]:
    """Every case of the matrix for these world sizes, largest first (a budget cut drops the small ones, already
    covered by a smaller machine)."""
    cases = []
    for g in sorted(worlds, reverse=True):
        cases += [Case(lay, "exact") for lay in layouts(g)]
        cases += [Case(Layout(g, 1, g), "exact", "static", rebalance=True), Case(Layout(g, g, g), "exact", "dynamic")]
        cases += [Case(lay, "default") for lay in layouts(g)[:4]]
    return cases
