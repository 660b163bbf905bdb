"""TokenDispatcher: how a MoE layer's tokens reach the experts that hold them, and come back.

Shape legend: T tokens on this rank, D hidden, K pairs per token (top-k, + S fused shared), E routed experts,
P physical slots (E + redundant replicas; P = E without them), G expert-parallel ranks, E_local = P / G, N rows
this rank sends (one per (token, destination rank)), R rows it receives.

The dispatcher works over physical slots: the MoE's map step (expert_map.py) turns the router's logical ids into
slots before dispatch, so "expert" below means a slot, and rank r holds slots [r * P/G, (r + 1) * P/G).

    dispatch(x [T, D], topk_ids [T, K], topk_weights [T, K]) -> Dispatched:
        hidden [R, D], topk_ids [R, K] int32 local ids (-1: expert elsewhere), topk_weights [R, K] fp32, handle
    experts_fn(hidden, w13_local, w2_local, topk_ids, topk_weights) -> expert_out [R, D] (weights applied)
    combine(expert_out [R, D], handle) -> [T, D], this rank's tokens in their order

Which one a MoE gets is decided once, when it is built: dispatcher_choice.make_dispatcher (its own module, so
that this one and low_latency_dispatcher.py, which imports Dispatched from here, import one way).

| dispatcher           | when                       | what it does                                                    |
| -------------------- | -------------------------- | --------------------------------------------------------------- |
| NullDispatcher       | one process (ep_size 1)    | nothing: the inputs are what the experts compute over           |
| AllToAllDispatcher   | ep_size > 1, "normal"      | DeepEP normal mode over torch.distributed.all_to_all_single     |
| LowLatencyDispatcher | ep_size > 1, "low_latency" | DeepEP low-latency layout, fixed sizes (low_latency_dispatcher) |

DeepEP normal mode (its get_dispatch_layout / dispatch / combine): rank r owns experts [r*E_local, (r+1)*E_local),
contiguous. A token goes once to every rank that owns at least one of its experts, with all K of its ids
translated to that rank's local ids (-1 for the ones elsewhere, weight 0 there), so the experts function skips
them (moe.py) and its own align (kernels/moe/align.py) does the expert-contiguous permute of the received rows.
Each rank returns one row per received token, its local pairs already weighted and summed; combine adds a
token's rows from the ranks in rank order. Shared experts are not dispatched: every rank computes them on its
own tokens (replicated, as under DeepEP), so fused shared experts (moe.py) are refused with expert parallelism.

Normal mode syncs the host once per dispatch (the received row count sizes the buffers), as DeepEP's does; it
cannot sit inside a CUDA graph. The low-latency layout ([E_local, max_tokens * G, D] with received counts) is
the graph-safe second mode. A rank with no tokens still joins every collective.

Summation order, fp32: normal mode adds a token's pairs on each rank in ascending slot order, then the ranks'
partial sums in rank order; the one-process MoE adds them in ascending expert order. With contiguous experts and
no replicas the two orders coincide; with replicas a token's slots follow the placement, so the sums agree to a
few ulps, not bitwise. The low-latency combine adds the K pairs in k order, whatever the placement.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist


class Dispatched(NamedTuple):
    hidden: torch.Tensor  # [R, D] rows the local experts compute over
    topk_ids: torch.Tensor  # [R, K] int32, local expert ids; -1: the pair's expert is on another rank
    topk_weights: torch.Tensor  # [R, K] fp32, 0 where the id is -1
    handle: Any  # what combine needs to bring the rows back (None for the NullDispatcher)


class TokenDispatcher(Protocol):
    experts: range  # the global ids of the routed experts this rank holds, in w13 / w2 row order

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched: ...

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor: ...


class NullDispatcher:
    """One process: every expert is local, nothing moves; the MoE's output is bitwise today's."""

    def __init__(self, num_experts: int) -> None:
        self.experts = range(num_experts)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        return Dispatched(x, topk_ids, topk_weights, None)

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        return expert_out


def local_experts(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """Rank ep_rank's contiguous share of E experts: [r * E/G, (r + 1) * E/G)."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} outside 0..{ep_size - 1} (ep_size={ep_size})")
    if num_experts % ep_size:
        raise ValueError(f"slots={num_experts} (n_routed_experts + redundant) is not a multiple of ep_size={ep_size}")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def expert_slice(weight: torch.Tensor, experts: range) -> torch.Tensor:
    """Full [E, ...] expert weights (w13, w2) -> this rank's rows [E_local, ...], contiguous (a copy)."""
    return weight[experts.start : experts.stop].contiguous()


def check_group(ep_rank: int, ep_size: int, group: dist.ProcessGroup | None) -> None:
    """The process group must agree with the ParallelInfo's ep_rank / ep_size (checked once, at construction)."""
    if dist.get_world_size(group) != ep_size or dist.get_rank(group) != ep_rank:
        raise ValueError(
            f"ep_rank={ep_rank}, ep_size={ep_size}: the process group says rank {dist.get_rank(group)} "
            f"of {dist.get_world_size(group)}"
        )


class DispatchLayout(NamedTuple):
    """Where this rank's tokens go (DeepEP's get_dispatch_layout, plus the rows to send)."""

    tokens_per_rank: torch.Tensor  # [G] int64, tokens sent to each rank (a token counts once per rank)
    tokens_per_expert: torch.Tensor  # [E] int64, (token, k) pairs per expert
    is_token_in_rank: torch.Tensor  # [T, G] bool
    send_token: torch.Tensor  # [N] int64, the token of each sent row: rank-major, token order within a rank
    send_ids: torch.Tensor  # [N, K] int32, the row's ids local to its destination, -1 for the others
    send_weights: torch.Tensor  # [N, K] fp32, 0 where send_ids is -1


def dispatch_layout(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, ep_size: int
) -> DispatchLayout:
    """topk_ids [T, K] global ids (-1: no expert), topk_weights [T, K] -> DispatchLayout; see the module docstring."""
    t, k = topk_ids.shape
    per_rank = num_experts // ep_size
    ids = topk_ids.long()  # [T, K]
    valid = ids >= 0
    dest = torch.where(valid, ids // per_rank, ep_size)  # [T, K], G: the pair goes nowhere
    hit = torch.zeros(t, ep_size + 1, dtype=torch.bool, device=ids.device)
    in_rank = hit.scatter_(1, dest, True)[:, :ep_size]  # [T, G]
    rank_of_row, send_token = in_rank.T.nonzero(as_tuple=True)  # [N] each, row-major over [G, T]: rank-major
    local = ids[send_token] - (rank_of_row * per_rank)[:, None]  # [N, K]
    on_dest = valid[send_token] & (local >= 0) & (local < per_rank)
    return DispatchLayout(
        tokens_per_rank=in_rank.sum(0),
        tokens_per_expert=torch.bincount(ids[valid], minlength=num_experts),
        is_token_in_rank=in_rank,
        send_token=send_token,
        send_ids=torch.where(on_dest, local, -1).to(torch.int32),
        send_weights=torch.where(on_dest, topk_weights[send_token].float(), 0.0),
    )


class A2AHandle(NamedTuple):
    send_token: torch.Tensor  # [N] int64, the layout's
    send_counts: list[int]  # [G] rows sent to each rank
    recv_counts: list[int]  # [G] rows received from each rank
    num_tokens: int  # T


class AllToAllDispatcher:
    """DeepEP normal-mode semantics over all_to_all_single (gloo on CPU, NCCL on CUDA).

    group: the expert-parallel process group (None: the default group); ep_rank / ep_size must be this
    process's rank and the size in that group (ParallelInfo carries them; checked here once).
    Collectives per dispatch: counts [G] int64, hidden rows [N, D], ids and weights packed as [N, 2K] int32
    (the fp32 weights travel as their bits). Per combine: rows [R, D] in the activation dtype, so in bf16 each
    rank's partial sum is rounded once before the fp32 sum over ranks (DeepEP's combine does the same; fp32 is
    exact up to the order of the additions).
    """

    def __init__(self, num_experts: int, ep_rank: int, ep_size: int, group: dist.ProcessGroup | None = None) -> None:
        self.experts = local_experts(num_experts, ep_rank, ep_size)
        check_group(ep_rank, ep_size, group)
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.group = group

    def _exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=self.group)
        return out

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        layout = dispatch_layout(topk_ids, topk_weights, self.num_experts, self.ep_size)
        counts_in = torch.empty_like(layout.tokens_per_rank)
        dist.all_to_all_single(counts_in, layout.tokens_per_rank, group=self.group)
        send, recv = layout.tokens_per_rank.tolist(), counts_in.tolist()  # host syncs: these and the layout's nonzero
        k = topk_ids.shape[1]
        meta = torch.cat([layout.send_ids, layout.send_weights.view(torch.int32)], dim=1)  # [N, 2K]
        meta_in = self._exchange(meta, send, recv)  # [R, 2K]
        hidden = self._exchange(x[layout.send_token], send, recv)  # [R, D]
        ids, weights = meta_in[:, :k].contiguous(), meta_in[:, k:].contiguous().view(torch.float32)
        return Dispatched(hidden, ids, weights, A2AHandle(layout.send_token, send, recv, x.shape[0]))

    def combine(self, expert_out: torch.Tensor, handle: A2AHandle) -> torch.Tensor:
        back = self._exchange(expert_out, handle.recv_counts, handle.send_counts)  # [N, D], rank-major
        out = torch.zeros(handle.num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
        # One add per expert rank, in rank order: a token comes back at most once from each, so each add is a plain
        # scatter and the sum over ranks has a fixed order (no atomics racing on a row).
        start = 0
        for n in handle.send_counts:
            rows = handle.send_token[start : start + n]
            out[rows] += back[start : start + n].float()
            start += n
        return out.to(expert_out.dtype)
