"""mla_decode with the wide Gluon stage 1 (DecodeTile(kernel="wide")) against mla_decode_ref, on the GPU only.

Gluon kernels do not run under TRITON_INTERPRET=1 (gluon.jit launches through the GPU driver), so these
tests are `gpu`-marked; test_mla_decode.py covers the Triton kernel on CPU. Run on an H100/H200:
     python -m pytest tests/kernels/test_mla_decode_gluon.py -q -m gpu
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.mla_decode import DecodeTile, mla_decode, mla_decode_ref, wide
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

GLUON = DecodeTile(64, 64, 8, 2, kernel="wide")
# mixed, 1 included, none a multiple of the 64-key tile but 64 and 128 themselves
LENS = [1, 700, 3001, 64, 1500, 33, 2049, 5, 999, 128, 65]


# (DecodeTile fields, the page sizes they apply to): gather_under_s is the cp.async form's (page 1); pages of 64 and
# 128 slots take the TMA form; a tile that promises page_size 1 runs the cp.async form on 64-slot pages
FLAG_CASES = {
    "default": ({}, (1, 64, 128)),
    "gl-max": ({"max_xchg": False}, (1, 64)),
    "gather-after-s": ({"gather_under_s": False}, (1,)),
    "row-stores": ({"coalesced_out": False}, (1, 64)),
    "cp-async": ({"page_size": 1}, (64,)),
}
SHAPES = {  # (H, kv_lora, rope, splits)
    "H128-7splits": (128, 512, 64, 7),
    "H80-ragged": (80, 512, 64, 5),
    "H64-1split": (64, 512, 64, 1),
    "kv256-rope32": (128, 256, 32, 3),
    "H16-64splits": (16, 512, 64, 64),
}
# every shape at the defaults, the switches at the first two (each flag set x shape is a ~4 s compile)
CASES = [
    pytest.param(*shape, f, p, id=f"{sname}-{name}-page{p}")
    for name, (f, pages) in FLAG_CASES.items()
    for sname, shape in (SHAPES.items() if name == "default" else list(SHAPES.items())[:2])
    for p in pages
]


@pytest.mark.skipif(not HOPPER, reason="the Gluon decode kernel is sm_90 only")
@pytest.mark.parametrize(("H", "kv_lora", "rope", "splits", "flags", "page_size"), CASES)
def test_gluon_matches_ref(
    H: int,
    kv_lora: int,
    rope: int,
    splits: int,
    page_size: int,
    flags: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fresh data; H = 80 leaves a ragged second head block (16 of 64 rows live; in the TMA form its q box
    reads the next request's heads, or zero-fills past the last); 64 splits leave most of the short requests'
    splits empty; page size 1 makes every row of a tile a separate gather, 64 and 128 take the TMA form
    (a tile's last rows past the request's end are real slots of its page, masked in the scores). The default
    schedule and each switch flipped (DecodeTile fields); the lengths give splits of odd and even tile counts (the
    loop takes tiles in pairs)."""
    picked: list[bool] = []  # what the launcher chose from the tile's page size
    usable = wide.tma_usable
    monkeypatch.setattr(wide, "tma_usable", lambda *a: picked.append(usable(*a)) or picked[-1])
    gen = torch.Generator().manual_seed(H + kv_lora + page_size)
    r2t, rows, S = paged_req_to_token(LENS, page_size, gen)
    q = torch.randn(len(LENS), H, kv_lora + rope, generator=gen).cuda().bfloat16()
    kv = torch.randn(S, kv_lora + rope, generator=gen).cuda().bfloat16()
    seq = torch.tensor(LENS, device="cuda")
    r2t, rows = r2t.cuda(), rows.cuda()
    scale = (kv_lora + rope) ** -0.5
    tile = GLUON._replace(page_size=page_size)._replace(**flags)
    out = mla_decode(q, kv, r2t, rows, seq, kv_lora, scale, num_kv_splits=splits, tile=tile)
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq, kv_lora, scale)
    assert picked == [tile.page_size % 64 == 0]
    assert_close_to_ref(out, ref, torch.bfloat16)
    triton_out = mla_decode(q, kv, r2t, rows, seq, kv_lora, scale, num_kv_splits=splits)
    # the same bf16 rounding of P and of the output as the Triton kernel: within a few bf16 ulps of it
    torch.testing.assert_close(out.float(), triton_out.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not HOPPER, reason="the Gluon decode kernel is sm_90 only")
@pytest.mark.parametrize("page_size", [1, 64])
def test_gluon_one_split_direct_same_bits_as_merge(page_size: int) -> None:
    """One split: the Gluon stage 1 stores the bf16 output itself; the two-stage twin (fp32 partial, merge with
    weight exp2(0) = 1) must give the same bits. H = 80 leaves a ragged second head block."""
    gen = torch.Generator().manual_seed(5 + page_size)
    r2t, rows, S = paged_req_to_token(LENS, page_size, gen)
    q = torch.randn(len(LENS), 80, 576, generator=gen).cuda().bfloat16()
    kv = torch.randn(S, 576, generator=gen).cuda().bfloat16()
    args = (q, kv, r2t.cuda(), rows.cuda(), torch.tensor(LENS, device="cuda"), 512, 576**-0.5, 1)
    tile = GLUON._replace(page_size=page_size)  # 64: the TMA form
    out = mla_decode(*args, tile=tile._replace(direct=True))  # the default Gluon tile's setting
    assert torch.equal(out, mla_decode(*args, tile=tile))
    assert_close_to_ref(out, mla_decode_ref(q.float(), kv.float(), *args[2:7]), torch.bfloat16)


def test_gluon_rejects_what_it_cannot_run() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 64, 24 + 8, generator=gen).cuda().bfloat16()
    kv = torch.randn(10, 32, generator=gen).cuda().bfloat16()
    r2t = torch.arange(10, device="cuda").view(2, 5).int()
    args = (kv, r2t, torch.arange(2, device="cuda"), torch.tensor([5, 3], device="cuda"))
    with pytest.raises(KernelInputError, match="kv_lora"):
        mla_decode(q, *args, 24, 0.2, tile=GLUON)
    q = torch.randn(2, 64, 576, generator=gen).cuda().bfloat16()
    kv = torch.randn(10, 576, generator=gen).cuda().bfloat16()
    with pytest.raises(KernelInputError, match="fixed"):
        mla_decode(q, kv, *args[1:], 512, 0.2, tile=DecodeTile(64, 32, 8, 2, kernel="wide"))


@pytest.mark.skipif(not HOPPER, reason="the Gluon decode kernel is sm_90 only")
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("page_size", [1, 64])
def test_gluon_under_cuda_graph(page_size: int, pdl: bool) -> None:
    """The engine replays decode from CUDA graphs: a captured call, replayed on new lengths and new cache contents,
    equals an eager call on them (page 64: the TMA form); with and without programmatic dependent launch (not the
    default here, a launch option the tile carries)."""
    assert_graph_replay_matches_eager(GLUON._replace(page_size=page_size, pdl=pdl), 128)
