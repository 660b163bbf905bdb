"""batch_invariant attention in launches of bounded partials (engine/layers/attention_backend.py PARTIAL_BYTES,
kernels/mla_decode/fixed_split.py row_chunks): the rows of a batch cut into several launches, whole requests together
and a long request in pieces, are bitwise the rows of one launch, and match the torch reference.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_invariant_chunks.py -q   (CPU)
"""

from __future__ import annotations

import pytest
import torch

import r3trace.engine.layers.attention_backend as backends
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.layers.attention_backend import InvariantAttention, RefAttention
from r3trace.kernels.mla_decode.fixed_split import row_chunks
from r3trace.kernels.mla_decode.registry import DecodeShape
from tests.kernels.conftest import DEVICE, assert_close_to_ref, paged_req_to_token, requires_triton

pytestmark = requires_triton
KV_LORA, ROPE, HEADS = 32, 16, 4


def test_row_chunks_cover_every_row_once_within_the_limit() -> None:
    assert row_chunks([4, 4, 4, 4], 8) == [(0, 2, 0, 8), (2, 4, 8, 16)]
    assert row_chunks([3, 20, 2, 2], 8) == [(0, 1, 0, 3), (1, 2, 3, 11), (1, 2, 11, 19), (1, 2, 19, 23),
                                            (2, 4, 23, 27)]
    assert row_chunks([5, 5], 100) == [(0, 2, 0, 10)]
    assert row_chunks([1, 1, 1], 0) == [(0, 1, 0, 1), (1, 2, 1, 2), (2, 3, 2, 3)]  # at least a row a launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bounded_launches_are_one_launch_bit_for_bit(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two decode rows, a 4-row verify, a 37-row chunk after 300 keys (two 256-key splits), one more verify: with the
    partials capped at 9 rows a launch the rows go out in 7 launches (the chunk in 5 pieces)."""
    prefix, extend = [20, 9, 300, 0, 64, 5], [1, 1, 4, 37, 4, 1]
    gen = torch.Generator().manual_seed(7)
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    req_to_token, rows, slots = paged_req_to_token(lens, 2, gen)
    t = sum(extend)
    q = torch.randn(t, HEADS, KV_LORA + ROPE, generator=gen).to(DEVICE, dtype)
    kv = torch.randn(slots, KV_LORA + ROPE, generator=gen).to(DEVICE, dtype)
    out_loc = torch.cat([req_to_token[r, p : p + e] for r, p, e in zip(rows.tolist(), prefix, extend, strict=True)])
    fb = ForwardBatch.build(forward_id=0, input_ids=[0] * t, prefix_lens=prefix, extend_lens=extend,
                            req_pool_indices=rows.tolist(), out_cache_loc=out_loc.numpy(),
                            req_to_token=req_to_token.to(DEVICE), logits_rows=[t - 1], device=DEVICE)
    attn = InvariantAttention(DecodeShape(HEADS, KV_LORA, ROPE), dtype)
    whole = attn.absorbed(q, kv, fb, KV_LORA, 0.3)
    per_row = HEADS * 2 * KV_LORA * 4  # two 256-key splits: the longest context is 337 keys
    monkeypatch.setattr(backends, "PARTIAL_BYTES", 9 * per_row)
    launches: list[int] = []
    real = attn.decoder

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    object.__setattr__(attn, "decoder", counted)
    object.__setattr__(counted, "split_keys", real.split_keys)
    cut = attn.absorbed(q, kv, fb, KV_LORA, 0.3)
    assert len(launches) == len(row_chunks(extend, 9)) == 7
    assert torch.equal(cut, whole)
    assert_close_to_ref(cut, RefAttention().absorbed(q.float(), kv.float(), fb, KV_LORA, 0.3), dtype)
