"""LowLatencyDispatcher: DeepEP's low-latency layout over fixed-size all_to_all_single (graph-safe).

Shape legend: T tokens on this rank (T <= M), M max_tokens per rank, K pairs per token, D hidden, P physical slots,
G expert-parallel ranks, E_local = P / G slots per rank.

DeepEP low_latency_dispatch / low_latency_combine (deepseek-ai/DeepEP README, low-latency section, as of
567632d): dispatch sends every (token, k) pair to its expert's rank and returns recv_x [E_local, M * G, D] with
recv_count [E_local], expert j's received tokens packed at the front of recv_x[j]; combine takes the experts'
unweighted outputs in that layout and returns, on each token's own rank, sum_k topk_weights[t, k] * out[t, k].
Every buffer has a size fixed by (P, M, G, D), so nothing reads a count on the host: the step is CUDA-graph safe.

    dispatch(x [T, D], topk_ids [T, K] physical slots, topk_weights [T, K]) -> Dispatched:
        hidden [E_local * M * G, D] (view [E_local, M * G, D]: recv_x), topk_ids [E_local * M * G, 1] the
        local slot of each row (-1: padding), topk_weights [.., 1] 1.0 (0 on padding), handle (recv_count)
    experts_fn(...) -> [E_local * M * G, D]: each row's expert output, unweighted (its weight is 1.0)
    combine(expert_out, handle) -> [T, D]

Collectives per dispatch: send counts [P] int64, rows [P * M, D]; per combine: rows [P * M, D]. The rows
exchanged do not depend on T: P * M * D elements each way, the price DeepEP's low-latency mode pays too.
Where DeepEP packs a slot's rows in arrival order, here they are packed by (source rank, token order): the same
rows, in an order that never changes between runs.

Combine sums a token's K weighted outputs in k order, in fp32 (DeepEP's low-latency combine order): the result
does not depend on where the replicas live, on G, or on static vs dynamic dispatch, bit for bit. The normal
mode adds per-rank partial sums instead, so the two modes agree to fp32 rounding (dispatcher.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .dispatcher import Dispatched, check_group, local_experts


class LowLatencyHandle(NamedTuple):
    send_row: torch.Tensor  # [T, K] int64, the pair's row in the [P * M] send buffer; P * M: no expert
    weights: torch.Tensor  # [T, K] fp32, 0 where the pair has no expert
    unpack_row: torch.Tensor  # [P * M] int64, packed row each received row went to; E_local * M * G: padding
    recv_count: torch.Tensor  # [E_local] int64, rows each local slot received (DeepEP's recv_count)
    num_tokens: int  # T


class LowLatencyDispatcher:
    """group: the expert-parallel process group (None: the default); ep_rank / ep_size as in AllToAllDispatcher."""

    def __init__(
        self, num_slots: int, ep_rank: int, ep_size: int, max_tokens: int, group: dist.ProcessGroup | None = None
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: the low-latency layout needs max_tokens >= 1 per rank")
        self.experts = local_experts(num_slots, ep_rank, ep_size)
        check_group(ep_rank, ep_size, group)
        self.num_slots = num_slots
        self.ep_size = ep_size
        self.max_tokens = max_tokens
        self.group = group

    @property
    def num_local(self) -> int:
        return len(self.experts)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        t, k = topk_ids.shape
        p, m, g, el = self.num_slots, self.max_tokens, self.ep_size, self.num_local
        if t > m:
            raise ValueError(f"{t} tokens on this rank; the low-latency layout holds max_tokens={m}")
        dev = x.device
        ids = topk_ids.long()  # [T, K]
        valid = ids >= 0
        slot = torch.where(valid, ids, p)  # [T, K], P: a spare column for pairs with no expert
        hits = torch.zeros(t, p + 1, dtype=torch.int64, device=dev).scatter_(1, slot, 1)  # [T, P + 1]
        # a token reaches a slot at most once (its K experts are distinct), so its row in the slot's block of M
        # is the number of earlier tokens that reached the slot
        pos = torch.gather(torch.cumsum(hits, 0) - hits, 1, slot)  # [T, K]
        send_row = torch.where(valid, slot * m + pos, p * m)  # [T, K]
        send = x.new_zeros(p * m + 1, x.shape[1])  # [P * M + 1, D]; the last row takes every pair with no expert
        d = x.shape[1]
        send.index_copy_(0, send_row.reshape(-1), x[:, None].expand(t, k, d).reshape(t * k, d))  # T = 0: no rows
        counts = torch.empty(p, dtype=torch.int64, device=dev)
        dist.all_to_all_single(counts, hits[:, :p].sum(0), group=self.group)  # [G src, E_local] rows per slot
        recv = torch.empty(p * m, x.shape[1], dtype=x.dtype, device=dev)
        dist.all_to_all_single(recv, send[: p * m], group=self.group)  # [G src, E_local, M, D]

        # pack: local slot j's rows from source s go to [offset[s, j], offset[s, j] + n[s, j]) of recv_x[j]
        n = counts.view(g, el)  # [G, E_local]
        offset = torch.cumsum(n, 0) - n  # [G, E_local]
        i = torch.arange(m, device=dev)  # [M]
        unpack_col = offset[:, :, None] + i  # [G, E_local, M] the packed column of each received row
        local = torch.arange(el, device=dev)[None, :, None]
        unpack_row = torch.where(i < n[:, :, None], local * (m * g) + unpack_col, el * m * g).reshape(-1)  # [P * M]
        packed = x.new_zeros(el * m * g + 1, x.shape[1])  # padding rows stay 0; the last row takes unused rows
        packed.index_copy_(0, unpack_row, recv)
        hidden = packed[: el * m * g]  # [E_local * M * G, D] = recv_x
        recv_count = n.sum(0)  # [E_local]
        filled = torch.arange(m * g, device=dev)[None, :] < recv_count[:, None]  # [E_local, M * G]
        row_ids = torch.where(filled, torch.arange(el, device=dev)[:, None], -1).reshape(-1, 1).to(torch.int32)
        row_w = filled.reshape(-1, 1).float()
        w = torch.where(valid, topk_weights.float(), 0.0)
        return Dispatched(hidden, row_ids, row_w, LowLatencyHandle(send_row, w, unpack_row, recv_count, t))

    def combine(self, expert_out: torch.Tensor, handle: LowLatencyHandle) -> torch.Tensor:
        padded = torch.cat([expert_out, expert_out.new_zeros(1, expert_out.shape[1])])  # the zero row: unused rows
        rows = padded.index_select(0, handle.unpack_row)  # [P * M, D] back in the received layout
        back = torch.empty_like(rows)
        dist.all_to_all_single(back, rows, group=self.group)  # [G dst, E_local, M, D] = [P, M, D]: this rank's pairs
        back = torch.cat([back, back.new_zeros(1, back.shape[1])])  # row P * M: pairs with no expert
        out = torch.zeros(handle.num_tokens, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
        for j in range(handle.send_row.shape[1]):  # k order, one fp32 add per pair: a fixed association
            out += back[handle.send_row[:, j]].float() * handle.weights[:, j, None]
        return out.to(expert_out.dtype)
