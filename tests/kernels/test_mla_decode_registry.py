"""The MLA decode's stage-1 registry (kernels/mla_decode/registry.py) and the decode resolved once for the attention
backend (decode.resolve_decoder): host logic, plus the Triton stage 1 under the interpreter on CPU.

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_mla_decode_registry.py -q
"""

from __future__ import annotations

import itertools

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.mla_decode import (
    DecodeShape,
    DecodeTile,
    default_decode_tile,
    mla_decode,
    mla_decode_ref,
    resolve_decoder,
    stage1,
)
from r3trace.kernels.mla_decode import decode as decode_mod
from r3trace.kernels.mla_decode.registry import STAGE1_NAMES, tile_error
from tests.kernels.conftest import assert_close_to_ref, paged_req_to_token, requires_triton

BF16 = torch.bfloat16


def test_every_default_tile_names_a_record_that_runs_it() -> None:
    """default_decode_tile's table and the records' supported() agree: across heads, dtypes, latent shapes (the
    tiny models' 24 + 8 included), page sizes and with or without Gluon, the tile the table picks is one its record
    says it runs, and Gluon records only where the caller allowed them."""
    heads, dtypes = (1, 16, 40, 64, 128), (BF16, torch.float16, torch.float32)
    latents, pages = ((512, 64), (128, 16), (512, 32), (256, 128), (24, 8)), (1, 3, 64, 128)
    seen = set()
    for H, dtype, (kv_lora, rope), page, gluon in itertools.product(heads, dtypes, latents, pages, (False, True)):
        tile = default_decode_tile(H, dtype, gluon, kv_lora, rope, page)
        record = stage1(tile.kernel)
        assert tile_error(record, tile) is None, tile
        assert record.supported(DecodeShape(H, kv_lora, rope), dtype, page) is None, tile
        assert gluon or not record.hopper, tile
        seen.add(tile.kernel)
    assert seen == set(STAGE1_NAMES)  # every record is somebody's default


def test_records_say_why_not() -> None:
    shape = DecodeShape(128, 512, 64)
    assert stage1("triton").supported(DecodeShape(3, 24, 8), torch.float32, 3) is None
    assert "bf16/fp16" in str(stage1("wide").supported(shape, torch.float32, 64))
    assert "kv_lora in" in str(stage1("narrow").supported(DecodeShape(16, 480, 64), BF16, 64))
    assert stage1("wide").supported(shape, BF16, 1) is None  # the cp.async form: any page size
    assert "rope must be 64" in str(stage1("seesaw").supported(DecodeShape(128, 512, 32), BF16, 64))
    assert "page_size 1 must be a multiple of 64" in str(stage1("seesaw").supported(shape, BF16, 1))
    assert "tile is fixed" in str(tile_error(stage1("narrow"), DecodeTile(16, 32, 4, 2, kernel="narrow")))
    assert tile_error(stage1("triton"), DecodeTile(16, 32, 4, 2, keys_major=True)) is None
    with pytest.raises(KernelInputError, match="'gluon' not in"):
        stage1("gluon")


def _inputs(H: int, kv_lora: int, rope: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 37, 5, 300]
    r2t, rows, S = paged_req_to_token(lens, 3, gen)
    q = torch.randn(len(lens), H, kv_lora + rope, generator=gen).to(dtype)
    kv = torch.randn(S, kv_lora + rope, generator=gen).to(dtype)
    return q, kv, r2t, rows, torch.tensor(lens)


def test_gluon_record_refused_off_hopper() -> None:
    q, kv, r2t, rows, seq = _inputs(64, 512, 64, BF16, 1)
    with pytest.raises(KernelInputError, match="needs a Hopper"):
        mla_decode(q, kv, r2t, rows, seq, 512, 0.05, tile=DecodeTile(64, 64, 8, 2, kernel="wide"))


@requires_triton
def test_resolved_decoder_runs_the_triton_tile_on_cpu() -> None:
    """Off the GPU the resolved decode is the Triton stage 1 with the default tile, 4 SMs assumed, no PDL; calling it
    gives mla_decode's bits with the same tile and split count (fp32 here: 2 splits, so the merge runs too), and the
    reference's values."""
    H, kv_lora, rope, f32 = 20, 24, 8, torch.float32
    dec = resolve_decoder(DecodeShape(H, kv_lora, rope), f32, 1, "cpu")
    assert (dec.stage1.name, dec.tile, dec.sm_count, dec.pdl) == ("triton", default_decode_tile(H, f32), 4, False)
    q, kv, r2t, rows, seq = _inputs(H, kv_lora, rope, f32, 2)
    splits = dec.num_kv_splits(len(seq), int(seq.max()))
    assert splits == dec.tile.num_kv_splits(len(seq), H, int(seq.max()), 4) > 1
    out = dec(q, kv, r2t, rows, seq, 0.2, splits)
    assert torch.equal(out, mla_decode(q, kv, r2t, rows, seq, kv_lora, 0.2, num_kv_splits=splits))
    assert_close_to_ref(out, mla_decode_ref(q, kv, r2t, rows, seq, kv_lora, 0.2), f32)
    with pytest.raises(KernelInputError, match="resolved for 20"):
        dec(q[:, :16].contiguous(), kv, r2t, rows, seq, 0.2, splits)


@pytest.mark.parametrize(
    ("major", "H", "rope", "page", "use_gluon", "want", "pdl"),
    [
        (9, 128, 64, 64, True, "seesaw", False),
        (9, 128, 64, 1, True, "wide", False),
        (9, 128, 32, 64, True, "wide", False),
        (9, 16, 64, 64, True, "narrow", True),
        (9, 16, 64, 1, True, "triton", True),
        (9, 128, 64, 64, False, "triton", False),  # EngineConfig.decode_kernel="triton"
        (8, 128, 64, 64, True, "triton", False),  # an A100: no Gluon record, no griddepcontrol
        (8, 16, 64, 64, True, "triton", False),
    ],
)
def test_resolve_decoder_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch, major: int, H: int, rope: int, page: int, use_gluon: bool, want: str, pdl: bool
) -> None:  # fmt: skip
    """What the attention backend resolves on a GPU of this compute capability (faked: host logic only)."""
    monkeypatch.setattr(decode_mod, "_major", lambda device: major)
    monkeypatch.setattr(decode_mod, "_sm_count", lambda index: 132)
    dec = resolve_decoder(DecodeShape(H, 512, rope), BF16, page, "cuda", use_gluon)
    assert (dec.stage1.name, dec.pdl, dec.sm_count) == (want, pdl, 132)
    assert dec.tile == default_decode_tile(H, BF16, use_gluon and major == 9, 512, rope, page)
