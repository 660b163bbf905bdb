"""mla_decode with merge="last" (no stage-2 launch: the last split program of a request merges it; one split
writes the output from stage 1) against mla_decode_ref, and the counters that make it graph-safe.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_mla_decode_merge.py -q   (CPU)
     python -m pytest tests/kernels/test_mla_decode_merge.py -q                                (GPU)
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels import mla_decode as md
from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.mla_decode import DecodeTile, mla_decode, mla_decode_ref
from tests.kernels.conftest import DEVICE, assert_close_to_ref, gpu, paged_req_to_token, requires_gpu, requires_triton

pytestmark = requires_triton

# mixed: 1 key, lengths off the 16-key tile, and 130 / 70 spanning several 64-slot pages
LENS = [1, 37, 5, 130, 29, 2, 70]
LAST = DecodeTile(16, 16, 4, 3, merge="last")  # 3 stages: the early-slots path the H = 16 default takes


def _case(
    lens: list[int], H: int, kv_lora: int, rope: int, page_size: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    req_to_token, rows, S = paged_req_to_token(lens, page_size, gen)
    q = torch.randn(len(lens), H, kv_lora + rope, generator=gen).to(device, dtype)
    kv_cache = torch.randn(S, kv_lora + rope, generator=gen).to(device, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    return q, kv_cache, req_to_token.to(device), rows.to(device), seq_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("num_kv_splits", [1, 3, 9])  # 1: direct write; 9: short requests leave splits empty
def test_merge_last_matches_ref(dtype: torch.dtype, page_size: int, num_kv_splits: int, poisoned_empty: None) -> None:
    """20 heads (a second, ragged head block), kv_lora 40 (not a power of two), fresh data per case."""
    q, kv, r2t, rows, seq_lens = _case(LENS, 20, 40, 8, page_size, dtype, DEVICE, seed=page_size + num_kv_splits)
    out = mla_decode(q, kv, r2t, rows, seq_lens, 40, 0.15, num_kv_splits=num_kv_splits, tile=LAST)
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq_lens, 40, 0.15)
    assert out.shape == (len(LENS), 20, 40) and out.dtype == dtype
    assert_close_to_ref(out, ref, dtype)


def test_merge_last_leaves_counts_at_zero_and_repeats_bits(poisoned_empty: None) -> None:
    """The merging program resets its count (a second launch, or a graph replay, needs no memset), and the
    merge sums splits in a fixed order whichever program merges, so two calls give the same bits."""
    q, kv, r2t, rows, seq_lens = _case(LENS, 5, 24, 8, 3, torch.bfloat16, DEVICE, seed=3)
    first = mla_decode(q, kv, r2t, rows, seq_lens, 24, 0.2, num_kv_splits=4, tile=LAST)
    counts = md._COUNTS[q.device][-1]
    assert counts.abs().sum().item() == 0
    assert torch.equal(first, mla_decode(q, kv, r2t, rows, seq_lens, 24, 0.2, num_kv_splits=4, tile=LAST))
    assert counts.abs().sum().item() == 0
    launched = mla_decode(q, kv, r2t, rows, seq_lens, 24, 0.2, num_kv_splits=4, tile=LAST._replace(merge="launch"))
    assert_close_to_ref(first, launched.float(), torch.bfloat16)


def test_merge_last_rejects_value_splits() -> None:
    q, kv, r2t, rows, seq_lens = _case([3, 4], 2, 40, 8, 1, torch.float32, DEVICE, seed=0)
    with pytest.raises(KernelInputError, match="v_splits 1"):
        mla_decode(q, kv, r2t, rows, seq_lens, 40, 0.2, num_kv_splits=2, tile=LAST._replace(v_splits=2))
    with pytest.raises(KernelInputError, match="merge"):
        mla_decode(q, kv, r2t, rows, seq_lens, 40, 0.2, tile=LAST._replace(merge="atomic"))  # type: ignore[arg-type]


@gpu
@requires_gpu
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("num_kv_splits", [1, 4, 33])
def test_merge_last_deepseek_shape_gpu(page_size: int, num_kv_splits: int) -> None:
    """DeepSeek's latent (512 + 64), H = 16, bf16, compiled: the counters under real concurrency."""
    lens = [1, 700, 3001, 64, 1500, 257]
    q, kv, r2t, rows, seq_lens = _case(lens, 16, 512, 64, page_size, torch.bfloat16, "cuda", seed=num_kv_splits)
    tile = DecodeTile(16, 32, 4, 3, merge="last")
    out = mla_decode(q, kv, r2t, rows, seq_lens, 512, 576**-0.5, num_kv_splits=num_kv_splits, tile=tile)
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq_lens, 512, 576**-0.5)
    assert_close_to_ref(out, ref, torch.bfloat16)
    again = mla_decode(q, kv, r2t, rows, seq_lens, 512, 576**-0.5, num_kv_splits=num_kv_splits, tile=tile)
    assert torch.equal(out, again)


@gpu
@requires_gpu
def test_merge_last_graph_replay_gpu() -> None:
    """Captured once after an eager call (which makes the counters), replayed on new lengths written into the
    captured seq_lens: the same bits as eager calls at those lengths, three replays in a row."""
    lens = [900, 33, 2500, 1, 640]
    q, kv, r2t, rows, seq_lens = _case(lens, 16, 512, 64, 64, torch.bfloat16, "cuda", seed=5)
    tile = DecodeTile(16, 32, 4, 3, merge="last")
    args = (q, kv, r2t, rows, seq_lens, 512, 576**-0.5, 8, tile)
    mla_decode(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(*args)
    for new in ([900, 33, 2500, 1, 640], [17, 2500, 5, 777, 64], [2500, 2500, 1, 2, 3]):
        seq_lens.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, mla_decode(*args)), new
