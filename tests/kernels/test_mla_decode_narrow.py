"""mla_decode with the narrow Gluon stage 1 (DecodeTile(kernel="narrow"), 16-head keys-major wgmma) against
mla_decode_ref, on a Hopper GPU only (Gluon does not run under TRITON_INTERPRET=1; test_mla_decode.py covers
the Triton kernel on CPU). Run on an H100/H200:
     python -m pytest tests/kernels/test_mla_decode_narrow.py -q -m gpu
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from r3trace.kernels import mla_decode_narrow
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

pytestmark = [requires_triton, gpu, requires_gpu]

NARROW = DecodeTile(16, 64, 4, 2, kernel="narrow", page_size=64)
# mixed, 1 included; 64, 128 and 65 at tile edges; the long ones give splits of odd and even tile counts
LENS = [1, 700, 3001, 64, 1500, 33, 2049, 5, 999, 128, 65]


def _inputs(H: int, kv_lora: int, rope: int, page_size: int, dtype: torch.dtype, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    r2t, rows, S = paged_req_to_token(LENS, page_size, gen)
    q = torch.randn(len(LENS), H, kv_lora + rope, generator=gen).cuda().to(dtype)
    kv = torch.randn(S, kv_lora + rope, generator=gen).cuda().to(dtype)
    return q, kv, r2t.cuda(), rows.cuda(), torch.tensor(LENS, device="cuda")


SHAPES = {  # (H, kv_lora, rope, splits)
    "H16-7splits": (16, 512, 64, 7),
    "H16-1split": (16, 512, 64, 1),
    "H16-64splits": (16, 512, 64, 64),  # most of the short requests' splits empty
    "H8": (8, 512, 64, 3),  # a ragged head block: the q box reads the next request's heads (or zero-fills)
    "H40": (40, 512, 64, 5),  # three head blocks, the last half empty
    "kv256-rope32": (16, 256, 32, 3),
}


# (page size, flags): 64 and 128 take the TMA form; 1 and 3 the cp.async row copies; 64 forced to cp.async
FORMS = {"tma-page64": (64, {}), "tma-page128": (128, {}), "rows-page1": (1, {}), "rows-page3": (3, {}),
         "rows-page64": (64, {"TMA": False})}  # fmt: skip


@pytest.mark.skipif(not HOPPER, reason="the narrow Gluon decode kernel is sm_90 only")
@pytest.mark.parametrize(("page_size", "flags"), list(FORMS.values()), ids=list(FORMS))
@pytest.mark.parametrize(("H", "kv_lora", "rope", "splits"), list(SHAPES.values()), ids=list(SHAPES))
def test_narrow_matches_ref(
    H: int, kv_lora: int, rope: int, splits: int, page_size: int, flags: dict[str, bool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Fresh data, pages shuffled; in the TMA form a tile's last rows past the request's end are real slots of its
    page, masked in the scores; cp.async zero-fills them. Within the bf16 table of the fp32 reference, and within a
    few bf16 ulps of the Triton kernel (the same bf16 rounding of P and of the output, another summation order)."""
    picked: list[bool] = []  # what the launcher chose from the page size (flags["TMA"] overrides it)
    usable = mla_decode_narrow.tma_usable
    monkeypatch.setattr(mla_decode_narrow, "tma_usable", lambda *a: picked.append(usable(*a)) or picked[-1])
    stage1 = partial(mla_decode_narrow.mla_decode_stage1_narrow, flags=flags)
    monkeypatch.setattr(mla_decode_narrow, "mla_decode_stage1_narrow", stage1)
    q, kv, r2t, rows, seq = _inputs(H, kv_lora, rope, page_size, torch.bfloat16, H + kv_lora + page_size)
    scale = (kv_lora + rope) ** -0.5
    out = mla_decode(q, kv, r2t, rows, seq, kv_lora, scale, num_kv_splits=splits,
                     tile=NARROW._replace(page_size=page_size))  # fmt: skip
    assert picked == [page_size % 64 == 0]
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq, kv_lora, scale)
    assert_close_to_ref(out, ref, torch.bfloat16)
    triton_out = mla_decode(q, kv, r2t, rows, seq, kv_lora, scale, num_kv_splits=splits)
    torch.testing.assert_close(out.float(), triton_out.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not HOPPER, reason="the narrow Gluon decode kernel is sm_90 only")
def test_narrow_fp16_and_one_split_direct() -> None:
    """fp16 inputs; one split stored straight into the output (direct) gives the bits the merge would."""
    for page_size in (1, 64):
        q, kv, r2t, rows, seq = _inputs(16, 512, 64, page_size, torch.float16, 9)
        args = (q, kv, r2t, rows, seq, 512, 576**-0.5, 1)
        tile = NARROW._replace(page_size=page_size)
        out = mla_decode(*args, tile=tile._replace(direct=True))
        assert torch.equal(out, mla_decode(*args, tile=tile))
        assert_close_to_ref(out, mla_decode_ref(q.float(), kv.float(), *args[2:7]), torch.float16)


@pytest.mark.skipif(not HOPPER, reason="the narrow Gluon decode kernel is sm_90 only")
def test_narrow_rejects_what_it_cannot_run() -> None:
    q, kv, r2t, rows, seq = _inputs(16, 512, 64, 64, torch.bfloat16, 4)
    with pytest.raises(KernelInputError, match="fixed"):
        mla_decode(q, kv, r2t, rows, seq, 512, 0.05, tile=NARROW._replace(block_n=32))
    with pytest.raises(KernelInputError, match="bf16/fp16"):
        mla_decode(q.float(), kv.float(), r2t, rows, seq, 512, 0.05, tile=NARROW)
    with pytest.raises(KernelInputError, match="kv_lora in"):
        mla_decode(q[..., :544], kv[:, :544], r2t, rows, seq, 480, 0.05, tile=NARROW)


@pytest.mark.skipif(not HOPPER, reason="the narrow Gluon decode kernel is sm_90 only")
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("page_size", [1, 64])
def test_narrow_under_cuda_graph(page_size: int, pdl: bool) -> None:
    """Graph replay equals eager (page 64: the TMA form); with and without programmatic dependent launch."""
    assert_graph_replay_matches_eager(NARROW._replace(page_size=page_size, pdl=pdl), 16)


@pytest.mark.skipif(not HOPPER, reason="the narrow Gluon decode kernel is sm_90 only")
def test_narrow_pdl_same_bits() -> None:
    """Programmatic dependent launch changes when the kernels start, not what they compute."""
    q, kv, r2t, rows, seq = _inputs(16, 512, 64, 64, torch.bfloat16, 21)
    args = (q, kv, r2t, rows, seq, 512, 576**-0.5, 5)
    assert torch.equal(mla_decode(*args, tile=NARROW._replace(pdl=True)), mla_decode(*args, tile=NARROW))


@pytest.mark.skipif(not HOPPER, reason="the narrow Gluon decode kernel is sm_90 only")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(("splits", "cluster"), [(4, 0), (2, 2)], ids=["merge-kernel", "cluster-2"])
def test_narrow_pdl_newest_row_written_just_before(splits: int, cluster: int, graph: bool) -> None:
    """DecodeTile.pdl's contract: the kernel launched just before the call may write q and each request's newest
    cache row. Under PDL the TMA form issues a split's tile 0 before griddepcontrol.wait unless that tile holds the
    request's last position, so that row must still be read after the wait. Here a copy writes q and an index_copy_
    writes the newest rows right before each call, eager and inside a CUDA graph replayed on fresh contents; the
    output must match the reference on what was written. The lengths put the newest row in a split's tile 0 (17, 65
    and 130 at 4 splits of 64 keys) and in later tiles (1000, 2049), beside splits whose tile 0 goes early."""
    gen = torch.Generator().manual_seed(11)
    lens = [17, 64, 65, 130, 1000, 2049]
    r2t, rows, S = paged_req_to_token(lens, 64, gen)
    r2t, rows = r2t.cuda(), rows.cuda()
    seq = torch.tensor(lens, device="cuda")
    newest = r2t[rows, seq - 1].long()  # [B]: the cache row of each request's last position
    q = torch.randn(len(lens), 16, 576, generator=gen).cuda().bfloat16()
    kv = torch.randn(S, 576, generator=gen).cuda().bfloat16()
    q_new, rows_new = torch.empty_like(q), torch.empty(len(lens), 576, dtype=torch.bfloat16, device="cuda")
    tile = NARROW._replace(pdl=True, cluster=cluster)
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
