"""ForwardBatch: everything one model forward needs, built by the scheduler, read by the model.

Shape legend: T new tokens in this forward (sum of extend_lens), B requests, S KV slots in the pool,
L layers, K top-k, C = kv_lora_rank + qk_rope_head_dim (one latent cache row).

Every request contributes `extend_lens[b]` new tokens at positions prefix_lens[b] .. seq_lens[b]-1. A
decode step is the special case extend_lens == 1; a prefill with no cached prefix has prefix_lens == 0.
The new tokens of request b are rows extend_start_loc[b] .. extend_start_loc[b]+extend_lens[b]-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

ForwardMode = Literal["extend", "decode"]
Phase = Literal["prefill", "decode", "verify"]


@dataclass
class ReplayPlan:
    """Forced routes for some rows of this forward (Rollout Routing Replay).

    topk_ids: [T, L, K] int32 logical expert ids indexed by model layer id (dense layers unused);
    row_mask: [T] bool, True where the row's routes are forced.
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
    out_cache_loc_cpu: torch.Tensor | None = None  # [T] int64 host copy (the scheduler has it anyway)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

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
        out_cache_loc: torch.Tensor,
        req_to_token: torch.Tensor,
        logits_rows: list[int],
        device: torch.device | str,
        request_ids: list[str] | None = None,
        phases: list[Phase] | None = None,
        replay: ReplayPlan | None = None,
    ) -> ForwardBatch:
        """Build a batch from host lists (one host->device copy per field, no device->host sync)."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=False)]
        starts, acc = [], 0
        positions: list[int] = []
        for p, e in zip(prefix_lens, extend_lens, strict=False):
            starts.append(acc)
            acc += e
            positions.extend(range(p, p + e))
        if acc != len(input_ids):
            raise ValueError(f"sum(extend_lens)={acc} != len(input_ids)={len(input_ids)}")

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        is_decode = all(e == 1 for e in extend_lens) and all(p > 0 for p in prefix_lens)
        mode: ForwardMode = "decode" if is_decode else "extend"
        return cls(
            forward_id=forward_id,
            mode=mode,
            input_ids=t(input_ids),
            positions=t(positions),
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            out_cache_loc_cpu=out_cache_loc.to(dtype=torch.int64) if out_cache_loc.device.type == "cpu" else None,
            req_pool_indices=t(req_pool_indices),
            seq_lens=t(seq_lens),
            prefix_lens=t(prefix_lens),
            extend_lens=t(extend_lens),
            extend_start_loc=t(starts),
            req_to_token=req_to_token,
            logits_indices=t(logits_rows),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens),
            request_ids=list(request_ids or []),
            phases=list(phases or []),
            replay=replay,
        )
