"""A random extend batch for the attention backends' tests: requests of extend[b] new rows after prefix[b] positions,
on a shuffled paged cache (bench/inputs.paged_req_to_token), with queries and latent keys drawn from one seeded
generator in a fixed order (table, q, kv), so a test's inputs depend on its seed alone."""

from __future__ import annotations

import torch

from r3trace.engine.forward_batch import ForwardBatch
from tests.kernels.conftest import DEVICE, paged_req_to_token


def attention_batch(prefix: list[int], extend: list[int], heads: int, kv_lora: int, rope: int, page_size: int,
                    dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    """-> q [T, H, kv_lora + rope], the latent cache [slots, kv_lora + rope], the ForwardBatch (logits at row T - 1)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    req_to_token, rows, slots = paged_req_to_token(lens, page_size, gen)
    t = sum(extend)
    q = torch.randn(t, heads, kv_lora + rope, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(slots, kv_lora + rope, generator=gen).to(DEVICE, dtype)
    out_loc = torch.cat([req_to_token[r, p : p + e] for r, p, e in zip(rows.tolist(), prefix, extend, strict=True)])
    fb = ForwardBatch.build(forward_id=0, input_ids=[0] * t, prefix_lens=prefix, extend_lens=extend,
                            req_pool_indices=rows.tolist(), out_cache_loc=out_loc.numpy(),
                            req_to_token=req_to_token.to(DEVICE), logits_rows=[t - 1], device=DEVICE)
    return q, kv, fb
