"""DecodeTile.pdl's contract on both Gluon decode stage 1s (narrow.py for 16 heads, wide.py
for 64-head blocks), on a Hopper GPU only: the kernel launched just before a PDL call may write q and each request's
newest cache row. The narrow kernel's TMA form issues a split's tile 0 before griddepcontrol.wait unless it holds the
request's last position, so that row must still be read after the wait; the wide kernel waits before it reads q or the
cache (it reads only the index tables before). Run on an H100/H200:
     python -m pytest tests/kernels/test_mla_decode_pdl.py -q -m gpu
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.mla_decode import DecodeTile, mla_decode, mla_decode_ref
from tests.kernels.conftest import HOPPER, assert_close_to_ref, gpu, paged_req_to_token, requires_gpu, requires_triton

pytestmark = [requires_triton, gpu, requires_gpu, pytest.mark.skipif(not HOPPER, reason="Gluon kernels: sm_90 only")]

NARROW = DecodeTile(16, 64, 4, 2, kernel="narrow", page_size=64, pdl=True)
WIDE = DecodeTile(64, 64, 8, 2, kernel="wide", direct=True, page_size=64, pdl=True)
# The newest row in a split's tile 0 (17, 65, 130 at 4 splits of 64 keys), in its tile 1 (500 at 4 splits of 128
# keys; 200 at 2 splits of 128), in later tiles (1000, 2049), beside splits whose tile 0 goes early
LENS = [17, 64, 65, 130, 200, 500, 1000, 2049]
CASES = {  # (tile, heads, splits)
    "narrow-merge-kernel": (NARROW, 16, 4),
    "narrow-cluster-2": (NARROW._replace(cluster=2), 16, 2),
    "wide-merge-kernel": (WIDE, 128, 4),
}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(("tile", "heads", "splits"), list(CASES.values()), ids=list(CASES))
def test_pdl_newest_row_written_just_before(tile: DecodeTile, heads: int, splits: int, graph: bool) -> None:
    """A copy writes q and an index_copy_ writes the newest rows right before each PDL call, eager and inside a CUDA
    graph replayed on fresh contents; the output must match the reference on what was written."""
    gen = torch.Generator().manual_seed(11 + heads)
    r2t, rows, S = paged_req_to_token(LENS, 64, gen)
    r2t, rows = r2t.cuda(), rows.cuda()
    seq = torch.tensor(LENS, device="cuda")
    newest = r2t[rows, seq - 1].long()  # [B]: the cache row of each request's last position
    q = torch.randn(len(LENS), heads, 576, generator=gen).cuda().bfloat16()
    kv = torch.randn(S, 576, generator=gen).cuda().bfloat16()
    q_new, rows_new = torch.empty_like(q), torch.empty(len(LENS), 576, dtype=torch.bfloat16, device="cuda")
    scale = 576**-0.5

    def step() -> torch.Tensor:
        q.copy_(q_new)
        kv.index_copy_(0, newest, rows_new)  # the kernel launched just before the decode
        return mla_decode(q, kv, r2t, rows, seq, 512, scale, num_kv_splits=splits, tile=tile)

    def fresh() -> None:  # new contents, 2x the scale so the newest key weighs more than a typical one
        q_new.copy_(torch.randn(q.shape, generator=gen).bfloat16())
        rows_new.copy_(2 * torch.randn(rows_new.shape, generator=gen).bfloat16())

    fresh()
    out = step()  # compiles outside any capture
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
    for _ in range(3):
        fresh()
        if graph:
            g.replay()
        else:
            out = step()
        assert torch.equal(kv[newest], rows_new)
        assert_close_to_ref(out, mla_decode_ref(q.float(), kv.float(), r2t, rows, seq, 512, scale), torch.bfloat16)

