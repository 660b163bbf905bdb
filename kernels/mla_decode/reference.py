"""The MLA decode's one reference, in plain torch: the kernels' tests compare against it and the engine's `ref`
attention backend runs it (engine/layers/attention_backend.py, absorbed extend and decode alike).

Shapes as in decode.py: C = kv_lora + rope; a request's n queries are the last n of its N keys (causal).
"""

from __future__ import annotations

import torch

from r3trace.kernels.mla_decode.decode import check_decode_args


def latent_attention_ref(q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """One request: q [n, H, C] over its latent rows kv [N, C], query i at key position N - n + i -> [n, H, kv_lora]
    fp32: softmax(q k^T * scale) over the visible keys in fp32, then times V = the rows' first kv_lora columns."""
    n, N = q.shape[0], kv.shape[0]
    kv = kv.float()
    scores = torch.einsum("nhc,kc->hnk", q.float(), kv) * scale  # [H, n, N]
    q_pos = torch.arange(N - n, N, device=q.device).unsqueeze(1)  # [n, 1]
    k_pos = torch.arange(N, device=q.device).unsqueeze(0)  # [1, N]
    probs = scores.masked_fill(k_pos > q_pos, float("-inf")).softmax(dim=-1)  # [H, n, N]
    return torch.einsum("hnk,kc->nhc", probs, kv[:, :kv_lora_rank])


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    sm_scale: float,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """mla_decode's contract, one request at a time: gather its seq_len latent rows through req_to_token and run
    latent_attention_ref (one query, every key visible). num_kv_splits is accepted and ignored."""
    check_decode_args(q, kv_cache, req_to_token, req_pool_indices, seq_lens, kv_lora_rank)
    B, H, _ = q.shape
    out = torch.empty((B, H, kv_lora_rank), dtype=q.dtype, device=q.device)
    for b in range(B):
        slots = req_to_token[int(req_pool_indices[b]), : int(seq_lens[b])].long()  # [n]
        out[b] = latent_attention_ref(q[b : b + 1], kv_cache[slots], kv_lora_rank, sm_scale)[0].to(q.dtype)
    return out
