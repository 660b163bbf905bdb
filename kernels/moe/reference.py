"""The fused MoE's one reference, in plain torch: the kernels' tests compare fused_moe against it and the engine's
`ref` MoE backend runs it (engine/layers/moe.py).

Shapes as in fused_moe.py: hidden [T, D], w13 [E, 2I, D] (gate rows, then up rows), w2 [E, D, I], topk_ids [T, K]
(-1: expert not on this rank, skipped), topk_weights [T, K] fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from r3trace.kernels.contract import FLOAT_DTYPES, INDEX_DTYPES, require, require_tensor


def fused_moe_ref(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """hidden [T, D] -> [T, D] in hidden's dtype: out[t] = sum_k topk_weights[t, k] * w2[e] (silu(w13[e, :I] x) *
    (w13[e, I:] x)), e = topk_ids[t, k]. Per expert, its pairs in pair order go through gate_up, SiLU-and-mul and down
    in the weights' dtype; each row is weighted in fp32 and added into an fp32 [T, D] in expert order, rounded once.
    One host sync (the per-expert pair counts)."""
    dev = hidden.device
    require_tensor("hidden", hidden, 2, FLOAT_DTYPES, dev)
    require_tensor("topk_ids", topk_ids, 2, INDEX_DTYPES, dev, contiguous_last=False)
    require_tensor("topk_weights", topk_weights, 2, FLOAT_DTYPES, dev, contiguous_last=False)
    require(w13.dim() == 3 and w2.dim() == 3 and w13.shape[2] == hidden.shape[1] == w2.shape[1],
            f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}: not [E, 2I, D], [E, D, I] with D={hidden.shape[1]}")
    require(topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == hidden.shape[0],
            f"topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)}: not [T={hidden.shape[0]}, K]")
    T, K = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()  # [T*K]
    order = torch.argsort(flat_ids, stable=True)  # [T*K] pairs grouped by expert, pair order within; -1 first
    token_of = order // K  # [T*K] the token of each sorted pair
    flat_w = topk_weights.reshape(-1)[order].float()  # [T*K]
    start = int((flat_ids < 0).sum())  # the skipped pairs sort first
    counts = torch.bincount(flat_ids[flat_ids >= 0], minlength=w13.shape[0]).tolist()  # [E], the one host sync
    out = torch.zeros(T, hidden.shape[1], dtype=torch.float32, device=dev)  # [T, D]
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]  # [n]
        gate, up = F.linear(hidden[rows], w13[expert]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w2[expert])  # [n, D]
        out.index_add_(0, rows, y.float() * flat_w[start : start + n, None])
        start += n
    return out.to(hidden.dtype)
