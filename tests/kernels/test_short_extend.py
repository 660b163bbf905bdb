"""The triton attention backend's short extends (a speculative verify's d + 1 rows, a short chunk): every request of at
most SHORT_EXTEND_ROWS rows runs token_block.py's stage 1 with the ordered merge, against the backend's torch
reference (RefAttention) on fresh random inputs; a longer extend still runs the extend kernel.

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_short_extend.py -q   (CPU)
     python -m pytest tests/kernels/test_short_extend.py -q                                (GPU)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.layers.attention_backend import SHORT_EXTEND_ROWS, RefAttention, TritonAttention
from r3trace.kernels.mla_decode import fixed_split, short_extend
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


# V3's 128 heads (bf16, 28 s in the interpreter) are in the slow set; 64 heads keep a multi-block head grid on the CPU
@pytest.mark.parametrize(("dtype", "heads", "page_size"), [(torch.float32, 3, 1), (torch.bfloat16, 16, 4),
                                                          (torch.float16, 5, 3), (torch.float32, 64, 2),
                                                          pytest.param(torch.bfloat16, 128, 1, marks=pytest.mark.slow)],
                         ids=str)
def test_short_extends_match_the_reference(dtype: torch.dtype, heads: int, page_size: int) -> None:
    """Verifies of 4 rows and shorter extends after prefixes of 0..300 keys, a request of no rows, and one of
    SHORT_EXTEND_ROWS rows; the extend kernel is never called."""
    prefix, extend = [0, 7, 255, 300, 12, 33], [4, 4, 1, SHORT_EXTEND_ROWS, 0, 3]
    q, kv, fb = batch(prefix, extend, heads, page_size, dtype, seed=heads)
    attn = backend(heads, page_size, dtype)

    def no_extend(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("a short extend ran the extend kernel")

    attn._extend = no_extend
    out = attn.absorbed(q, kv, fb, KV_LORA, 0.3)
    ref = RefAttention().absorbed(q.float(), kv.float(), fb, KV_LORA, 0.3)
    assert_close_to_ref(out, ref, dtype)
    # H >= 64 (a token-block program holds one row): every row runs as a decode of its own keys
    assert (attn._short_extend == attn._rows_as_decodes) == (heads >= 64)


@pytest.mark.parametrize(("prefix", "extend", "splits"), [([4600, 2], [4, 3], 16), ([300, 0, 90], [4, 4, 1], 3),
                                                     ([1000], [4], 5), ([40, 700], [8, 2], 1)], ids=str)
def test_each_block_cuts_its_own_splits(prefix: list[int], extend: list[int], splits: int) -> None:
    """Each block cuts its own longest row into `splits` runs of whole tiles, >= min_split keys each, on the device;
    stage 1 records that size for each of the block's rows, and every row matches the reference."""
    heads = 4
    q, kv, fb = batch(prefix, extend, heads, 1, torch.float32, seed=len(prefix) + splits)
    short = backend(heads, 1, torch.float32).short
    row_split: list[torch.Tensor] = []
    real = fixed_split.ordered_merge

    def spied(*args: Any) -> None:
        row_split.append(args[-1].cpu())
        real(*args)

    fixed_split.ordered_merge = spied  # type: ignore[assignment]
    try:
        out = short(q, kv, fb.req_to_token, fb.req_pool_indices, fb.extend_start_loc, fb.extend_lens,
                    fb.positions + 1, KV_LORA, 0.3, splits, max(extend))  # fmt: skip
    finally:
        fixed_split.ordered_merge = real  # type: ignore[assignment]
    assert_close_to_ref(out, RefAttention().absorbed(q.float(), kv.float(), fb, KV_LORA, 0.3), torch.float32)
    tile, keys = short.tile, (fb.positions + 1).cpu()
    expected = []
    for b, e in enumerate(extend):
        start = sum(extend[:b])
        for r in range(e):
            longest = int(keys[start + min(e, (r // tile.tokens + 1) * tile.tokens) - 1])
            size = max(-(-longest // splits), short.min_split)
            expected.append(-(-size // tile.block_n) * tile.block_n)
    assert row_split[0].tolist() == expected


def test_the_split_count_is_the_cost_models_least() -> None:
    """At the H200's 132 SMs and H = 16 (one block of 4 rows a request): few programs take many splits (idle SMs),
    a full machine few; the count is the least of split_cost over 1 .. max_splits, as the bench fitted it."""
    short = short_extend.ShortExtendDecoder(backend(16, 1, torch.bfloat16).short.tile, 64, 16, 132)

    def least(batch: int, keys: int) -> int:
        costs = [short_extend.split_cost(keys, p, batch, 132, batch * 4 * 16, 64, short.tile.block_n)
                 for p in range(1, 17)]  # fmt: skip
        return 1 + costs.index(min(costs))

    for batch, keys in [(1, 8192), (1, 260), (8, 8192), (32, 8192), (64, 8192), (132, 300)]:
        assert short.num_splits(batch, 16, 4, keys, batch * 4) == least(batch, keys)
    assert short.num_splits(1, 16, 4, 8192, 4) == 16 and short.num_splits(32, 16, 4, 8192, 128) == 4
    assert short.num_splits(64, 16, 4, 8192, 256) == 2 and short.num_splits(132, 16, 4, 300, 528) == 1
    assert short.num_splits(1, 16, 4, 260, 4) == 5  # 260 keys: five one-tile splits


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
