"""ForwardBatch: everything one model forward needs, built by the scheduler, read by the model.

Shape legend: T new tokens in this forward (sum of extend_lens), B requests, S KV slots in the pool,
L layers, K top-k, C = kv_lora_rank + qk_rope_head_dim (one latent cache row).

Every request contributes `extend_lens[b]` new tokens at positions prefix_lens[b] .. seq_lens[b]-1. A
decode step is the special case extend_lens == 1; a prefill with no cached prefix has prefix_lens == 0.
The new tokens of request b are rows extend_start_loc[b] .. extend_start_loc[b]+extend_lens[b]-1.

Under DP attention every field above is this DP rank's own (its requests, its KV pool); `dp_layout` says where
these rows sit in the batch gathered from every DP rank (dp_layout.py), and `route_rows` which rows of the
routed batch are this rank's (what route capture reads). A rank with no requests runs `ForwardBatch.idle`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import torch

from r3trace.capture.recorder import RowRange

from .dp_layout import DpLayout

ForwardMode = Literal["extend", "decode"]
Phase = Literal["prefill", "decode", "verify"]


def leading_decodes(phases: list[Phase], without_phases: int) -> int:
    """How many requests from the first are in decode or verify phase; without_phases when phases are not given (a
    decode batch's every request, an extend's none)."""
    if not phases:
        return without_phases
    n = 0
    while n < len(phases) and phases[n] in ("decode", "verify"):
        n += 1
    return n


@dataclass
class ReplayPlan:
    """Forced routes for some rows of this forward (Rollout Routing Replay).

    topk_ids: [T, L, K] int32 logical expert ids indexed by model layer id (dense layers unused);
    row_mask: [T] bool, True where the row's routes are forced.
    T is this rank's rows as the scheduler builds it; inside the model the plan is moved to the rows the router
    runs over (communicator.RouteCommunicator.moe_batch: gathered under DP attention, scattered under EP).
    """

    topk_ids: torch.Tensor
    row_mask: torch.Tensor


@dataclass
class ForwardBatch:
    forward_id: int
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot each new token is written to
    req_pool_indices: torch.Tensor  # [B] int64, row of req_to_token per request
    seq_lens: torch.Tensor  # [B] int64, prefix + extend
    prefix_lens: torch.Tensor  # [B] int64, tokens already in the KV cache
    extend_lens: torch.Tensor  # [B] int64, new tokens in this forward
    extend_start_loc: torch.Tensor  # [B] int64, first row of each request in T
    req_to_token: torch.Tensor  # [R, max_context] int32, position -> KV slot
    logits_indices: torch.Tensor  # [N] int64 rows of T whose logits are computed
    # host copies: the scheduler knows these without a device sync
    seq_lens_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)  # per request
    replay: ReplayPlan | None = None
    dp_rank: int = 0
    out_cache_loc_cpu: np.ndarray | None = None  # [T] int64 host copy (the scheduler has it anyway)
    dp_layout: DpLayout | None = None  # DP attention: every DP rank's rows this forward; None: no DP attention
    # where the routed batch's rows start in the route recorder's device buffer: 0, except the later forwards of a
    # chained speculative launch (spec/greedy_step.py), each writing past the one before until the host reads them
    route_row0: int = 0
    # The leading requests whose phase is decode or verify, and their rows: the row-invariant mode runs them on the
    # absorbed MLA path and the rest (prompt chunks) on the normal one (the scheduler puts decodes and verifies first)
    lead_requests: int = 0
    lead_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def route_rows(self) -> RowRange:
        """This rank's rows within the batch the router runs over: [0, T) without DP attention."""
        if self.dp_layout is None:
            return RowRange(0, self.num_tokens)
        return self.dp_layout.route_rows

    @property
    def has_prefix(self) -> bool:
        return any(p > 0 for p in self.prefix_lens_cpu)

    @classmethod
    def build(
        cls,
        *,
        forward_id: int,
        input_ids: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        req_pool_indices: list[int],
        out_cache_loc: torch.Tensor | np.ndarray,
        req_to_token: torch.Tensor,
        logits_rows: list[int],
        device: torch.device | str,
        request_ids: list[str] | None = None,
        phases: list[Phase] | None = None,
        replay: ReplayPlan | None = None,
        stage: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> ForwardBatch:
        """Build a batch from host lists: every int64 field goes to the device in ONE copy (views of one
        packed buffer). Per-field copies were 9 cudaMemcpy calls a step, ~0.2 ms of host time on the H200.
        stage: how the packed host array reaches the device (the engine's HostStaging: pinned, never waits on
        the GPU); default a plain non-blocking copy."""
        ext = np.asarray(extend_lens, dtype=np.int64)  # [B]
        pre = np.asarray(prefix_lens, dtype=np.int64)
        if int(ext.sum()) != len(input_ids):
            raise ValueError(f"sum(extend_lens)={int(ext.sum())} != len(input_ids)={len(input_ids)}")
        t, b = len(input_ids), len(ext)
        starts = np.cumsum(ext) - ext  # [B] first row of each request
        positions = np.repeat(pre - starts, ext) + np.arange(t, dtype=np.int64)  # [T] pre[b] + (row - start[b])
        # Slots already on the device (a caller's tensor) stay there; host slots travel in the packed copy.
        on_device = isinstance(out_cache_loc, torch.Tensor) and out_cache_loc.device.type != "cpu"
        loc_host = None if on_device else np.asarray(out_cache_loc, dtype=np.int64)
        parts = [np.asarray(input_ids, dtype=np.int64), positions, np.asarray(req_pool_indices, dtype=np.int64),
                 pre + ext, pre, ext, starts, np.asarray(logits_rows, dtype=np.int64)]
        if loc_host is not None:
            parts.append(loc_host)
        flat = np.concatenate(parts)
        packed = stage(flat) if stage is not None else torch.from_numpy(flat).to(device, non_blocking=True)
        sizes = [t, t, b, b, b, b, b, len(logits_rows)] + ([t] if loc_host is not None else [])
        views = packed.split(sizes)
        loc = views[8] if loc_host is not None else torch.as_tensor(out_cache_loc).to(device=device, dtype=torch.int64)
        is_decode = bool((ext == 1).all() and (pre > 0).all())
        mode: ForwardMode = "decode" if is_decode else "extend"
        lead = leading_decodes(list(phases or []), b if is_decode else 0)
        return cls(
            forward_id=forward_id,
            mode=mode,
            input_ids=views[0],
            positions=views[1],
            out_cache_loc=loc,
            out_cache_loc_cpu=loc_host,
            req_pool_indices=views[2],
            seq_lens=views[3],
            prefix_lens=views[4],
            extend_lens=views[5],
            extend_start_loc=views[6],
            req_to_token=req_to_token,
            logits_indices=views[7],
            seq_lens_cpu=(pre + ext).tolist(),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens),
            request_ids=list(request_ids or []),
            phases=list(phases or []),
            replay=replay,
            lead_requests=lead,
            lead_rows=int(ext[:lead].sum()),
        )

    def requests(self, b0: int, b1: int) -> ForwardBatch:
        """Requests b0 .. b1 - 1 as a batch of their own rows (the row-invariant MLA's two paths): device fields are
        views, extend_start_loc shifted to the sub-batch's first row; no logits, routes or replay (the model's)."""
        if (b0, b1) == (0, self.batch_size):
            return self
        r0 = sum(self.extend_lens_cpu[:b0])
        r1 = r0 + sum(self.extend_lens_cpu[b0:b1])
        ext = self.extend_lens_cpu[b0:b1]
        return replace(
            self, mode="decode" if all(n == 1 for n in ext) and all(p > 0 for p in self.prefix_lens_cpu[b0:b1])
            else "extend",
            input_ids=self.input_ids[r0:r1], positions=self.positions[r0:r1], out_cache_loc=self.out_cache_loc[r0:r1],
            req_pool_indices=self.req_pool_indices[b0:b1], seq_lens=self.seq_lens[b0:b1],
            prefix_lens=self.prefix_lens[b0:b1], extend_lens=self.extend_lens[b0:b1],
            extend_start_loc=self.extend_start_loc[b0:b1] - r0, logits_indices=self.logits_indices[:0],
            seq_lens_cpu=self.seq_lens_cpu[b0:b1], prefix_lens_cpu=self.prefix_lens_cpu[b0:b1], extend_lens_cpu=ext,
            request_ids=self.request_ids[b0:b1], phases=self.phases[b0:b1], replay=None, out_cache_loc_cpu=None,
            dp_layout=None, lead_requests=0, lead_rows=0,
        )  # fmt: skip

    @classmethod
    def idle(
        cls, *, forward_id: int, req_to_token: torch.Tensor, device: torch.device | str, dp_layout: DpLayout | None,
        dp_rank: int = 0,
    ) -> ForwardBatch:
        """A forward of 0 tokens for a DP rank with no requests: it still joins every collective of the
        others' forward (DP gathers, EP dispatch), so its layers run on empty tensors (attention is skipped)."""
        fb = cls.build(
            forward_id=forward_id, input_ids=[], prefix_lens=[], extend_lens=[], req_pool_indices=[],
            out_cache_loc=np.zeros(0, np.int64), req_to_token=req_to_token, logits_rows=[], device=device,
        )
        fb.dp_layout, fb.dp_rank = dp_layout, dp_rank
        return fb
