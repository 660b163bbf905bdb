"""mla_decode with the narrow Gluon stage 1 (DecodeTile(kernel="narrow"), 16-head keys-major wgmma) against
mla_decode_ref, on a Hopper GPU only (Gluon does not run under TRITON_INTERPRET=1; test_mla_decode.py covers
the Triton kernel on CPU). Run on an H100/H200:
     python -m pytest tests/kernels/test_mla_decode_narrow.py -q -m gpu
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.mla_decode import DecodeTile, mla_decode, mla_decode_ref, narrow
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


# (the pool's page size, the tile's): 64 and 128 take the TMA form; 1 and 3 the cp.async row copies; 64-slot pages
# under a tile that promises only page size 1 take the cp.async form too
FORMS = {"tma-page64": (64, 64), "tma-page128": (128, 128), "rows-page1": (1, 1), "rows-page3": (3, 3),
         "rows-page64": (64, 1)}  # fmt: skip


@pytest.mark.skipif(not HOPPER, reason="the narrow Gluon decode kernel is sm_90 only")
@pytest.mark.parametrize(("page_size", "tile_page"), list(FORMS.values()), ids=list(FORMS))
@pytest.mark.parametrize(("H", "kv_lora", "rope", "splits"), list(SHAPES.values()), ids=list(SHAPES))
def test_narrow_matches_ref(
    H: int, kv_lora: int, rope: int, splits: int, page_size: int, tile_page: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Fresh data, pages shuffled; in the TMA form a tile's last rows past the request's end are real slots of its
    page, masked in the scores; cp.async zero-fills them. Within the bf16 table of the fp32 reference, and within a
    few bf16 ulps of the Triton kernel (the same bf16 rounding of P and of the output, another summation order)."""
    picked: list[bool] = []  # what the launcher chose from the tile's page size
    usable = narrow.tma_usable
    monkeypatch.setattr(narrow, "tma_usable", lambda *a: picked.append(usable(*a)) or picked[-1])
    q, kv, r2t, rows, seq = _inputs(H, kv_lora, rope, page_size, torch.bfloat16, H + kv_lora + page_size)
    scale = (kv_lora + rope) ** -0.5
    out = mla_decode(q, kv, r2t, rows, seq, kv_lora, scale, num_kv_splits=splits,
                     tile=NARROW._replace(page_size=tile_page))  # fmt: skip
    assert picked == [tile_page % 64 == 0]
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
