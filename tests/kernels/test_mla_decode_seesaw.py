"""mla_decode with the seesaw stage 1 (DecodeTile(kernel="seesaw"), kernels/mla_decode/seesaw.py) against
mla_decode_ref and against the wide Gluon kernel, on the GPU only (Gluon does not run under TRITON_INTERPRET=1).
Run on an H100/H200:  python -m pytest tests/kernels/test_mla_decode_seesaw.py -q -m gpu
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.mla_decode import DecodeTile, mla_decode, mla_decode_ref
from tests.kernels.conftest import (
    HOPPER,
    assert_close_to_ref,
    assert_graph_replay_matches_eager,
    gpu,
    paged_req_to_token,
    requires_gpu,
    requires_triton,
)

pytestmark = [requires_triton, gpu, requires_gpu, pytest.mark.skipif(not HOPPER, reason="sm_90 only")]

SEESAW = DecodeTile(64, 64, 8, 2, kernel="seesaw", page_size=64)
WIDE = DecodeTile(64, 64, 8, 2, kernel="wide", page_size=64)
# 1 tile, 2 tiles exactly, odd tile counts (the pair loop's lone last tile), lengths off the 64-key tile
LENS = [1, 700, 3001, 64, 1500, 33, 2049, 5, 999, 128, 65, 191]


@pytest.mark.parametrize(
    ("H", "kv_lora", "splits", "page_size"),
    [(128, 512, 7, 64), (80, 512, 5, 64), (64, 512, 1, 128), (128, 256, 3, 64), (128, 512, 64, 64)],
    ids=["H128-7splits", "H80-ragged", "H64-1split-page128", "kv256", "H128-64splits"],
)
def test_seesaw_matches_ref(H: int, kv_lora: int, splits: int, page_size: int) -> None:
    """Fresh data. H = 80: a ragged second head block (its q box reads the next request's heads or zero-fills past
    the last; those rows are never stored). 64 splits: most of the short requests' splits empty (no tiles: the
    program stores nothing and the merge skips it) and many of one tile (WG1 then has no tile of its own).
    kv_lora 256: each warpgroup's half of O is 128 columns. The same inputs through the wide Gluon kernel
    agree within a few bf16 ulps (both round P and the output to bf16, at other points of the softmax)."""
    gen = torch.Generator().manual_seed(H + kv_lora + splits)
    r2t, rows, S = paged_req_to_token(LENS, page_size, gen)
    q = torch.randn(len(LENS), H, kv_lora + 64, generator=gen).cuda().bfloat16()
    kv = torch.randn(S, kv_lora + 64, generator=gen).cuda().bfloat16()
    args = (q, kv, r2t.cuda(), rows.cuda(), torch.tensor(LENS, device="cuda"), kv_lora, (kv_lora + 64) ** -0.5)
    out = mla_decode(*args, num_kv_splits=splits, tile=SEESAW._replace(page_size=page_size, direct=splits == 1))
    ref = mla_decode_ref(q.float(), kv.float(), *args[2:])
    assert_close_to_ref(out, ref, torch.bfloat16)
    wide = mla_decode(*args, num_kv_splits=splits, tile=WIDE._replace(page_size=page_size))
    torch.testing.assert_close(out.float(), wide.float(), atol=2e-2, rtol=2e-2)


def test_seesaw_under_cuda_graph() -> None:
    """A captured call replayed on new lengths and cache contents equals an eager call on them."""
    assert_graph_replay_matches_eager(SEESAW, 128)


def test_seesaw_rejects_what_it_cannot_run() -> None:
    """Pages not a multiple of 64 (no TMA form here) and rope other than 64 (P lives in a tile's rope rows)."""
    gen = torch.Generator().manual_seed(1)
    r2t, rows, S = paged_req_to_token([100, 7], 1, gen)
    q = torch.randn(2, 64, 576, generator=gen).cuda().bfloat16()
    kv = torch.randn(S, 576, generator=gen).cuda().bfloat16()
    args = (kv, r2t.cuda(), rows.cuda(), torch.tensor([100, 7], device="cuda"), 512, 0.05, 2)
    with pytest.raises(KernelInputError, match="page_size 1"):
        mla_decode(q, *args, tile=SEESAW._replace(page_size=1))
    q32 = torch.randn(2, 64, 512 + 32, generator=gen).cuda().bfloat16()
    kv32 = torch.randn(S, 512 + 32, generator=gen).cuda().bfloat16()
    with pytest.raises(KernelInputError, match="rope must be 64"):
        mla_decode(q32, kv32, *args[1:], tile=SEESAW)
