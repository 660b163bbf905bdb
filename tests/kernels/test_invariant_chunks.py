"""batch_invariant attention in launches of bounded partials (engine/layers/attention_backend.py PARTIAL_BYTES,
kernels/mla_decode/fixed_split.py row_chunks): the rows of a batch cut into several launches, whole requests together
and a long request in pieces, are bitwise the rows of one launch, and match the torch reference.

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_invariant_chunks.py -q   (CPU)
"""

from __future__ import annotations

import pytest
import torch

import r3trace.engine.layers.attention_backend as backends
from r3trace.engine.layers.attention_backend import InvariantAttention, RefAttention
from r3trace.kernels.mla_decode.fixed_split import row_chunks
from r3trace.kernels.mla_decode.registry import DecodeShape
from tests.kernels.attention_batch import attention_batch
from tests.kernels.conftest import assert_close_to_ref, requires_triton

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
    q, kv, fb = attention_batch(prefix, extend, HEADS, KV_LORA, ROPE, 2, dtype, seed=7)
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
