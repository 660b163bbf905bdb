"""The triton attention backend's short extends (a speculative verify's d + 1 rows, a short chunk): every request of at
most SHORT_EXTEND_ROWS rows runs token_block.py's stage 1 with the ordered merge, against the backend's torch
reference (RefAttention) on fresh random inputs; a longer extend still runs the extend kernel.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_short_extend.py -q   (CPU)
     python -m pytest tests/kernels/test_short_extend.py -q                                (GPU)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.layers.attention_backend import SHORT_EXTEND_ROWS, RefAttention, TritonAttention
from r3trace.kernels.mla_decode.registry import DecodeShape
from tests.kernels.attention_batch import attention_batch
from tests.kernels.conftest import DEVICE, assert_close_to_ref, requires_triton

pytestmark = requires_triton
KV_LORA, ROPE = 32, 16


def batch(prefix: list[int], extend: list[int], heads: int, page_size: int, dtype: torch.dtype,
          seed: int) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    return attention_batch(prefix, extend, heads, KV_LORA, ROPE, page_size, dtype, seed)


def backend(heads: int, page_size: int, dtype: torch.dtype) -> TritonAttention:
    return TritonAttention(DEVICE, "triton", page_size, DecodeShape(heads, KV_LORA, ROPE), dtype)


@pytest.mark.parametrize(("dtype", "heads", "page_size"), [(torch.float32, 3, 1), (torch.bfloat16, 16, 4),
                                                          (torch.float16, 5, 3)], ids=str)
def test_short_extends_match_the_reference(dtype: torch.dtype, heads: int, page_size: int) -> None:
    """Verifies of 4 rows and shorter extends after prefixes of 0..300 keys (one and two 256-key splits), and one
    request of SHORT_EXTEND_ROWS rows; the extend kernel is never called."""
    prefix, extend = [0, 7, 255, 300, 33], [4, 4, 1, SHORT_EXTEND_ROWS, 3]
    q, kv, fb = batch(prefix, extend, heads, page_size, dtype, seed=heads)
    attn = backend(heads, page_size, dtype)

    def no_extend(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("a short extend ran the extend kernel")

    attn._extend = no_extend
    out = attn.absorbed(q, kv, fb, KV_LORA, 0.3)
    ref = RefAttention().absorbed(q.float(), kv.float(), fb, KV_LORA, 0.3)
    assert_close_to_ref(out, ref, dtype)


def test_a_long_context_takes_wider_splits() -> None:
    """A 4.6k-key context is more than 16 splits of 256 keys: the splits widen to 320 keys (a multiple of the tile's),
    the partials stay 16 a row, and the rows still match the reference."""
    prefix, extend = [4600, 2], [4, 3]
    q, kv, fb = batch(prefix, extend, 4, 1, torch.float32, seed=1)
    attn = backend(4, 1, torch.float32)
    splits: list[int] = []
    real = attn._short

    def spied(split_keys: int) -> Any:
        splits.append(split_keys)
        return real(split_keys)

    attn._short = spied
    out = attn.absorbed(q, kv, fb, KV_LORA, 0.3)
    assert splits == [-(-4604 // 16 // 32) * 32] and splits[0] > 256
    assert_close_to_ref(out, RefAttention().absorbed(q.float(), kv.float(), fb, KV_LORA, 0.3), torch.float32)


def test_a_longer_extend_runs_the_extend_kernel() -> None:
    prefix, extend = [5, 0], [SHORT_EXTEND_ROWS + 1, 2]
    q, kv, fb = batch(prefix, extend, 3, 1, torch.float32, seed=2)
    attn = backend(3, 1, torch.float32)
    calls = [0]
    real = attn._extend

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return real(*args, **kwargs)

    attn._extend = counted
    out = attn.absorbed(q, kv, fb, KV_LORA, 0.3)
    assert calls[0] == 1
    assert_close_to_ref(out, RefAttention().absorbed(q.float(), kv.float(), fb, KV_LORA, 0.3), torch.float32)
