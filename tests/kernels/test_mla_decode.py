"""mla_decode (Triton, split-KV flash decoding) against mla_decode_ref (per-request torch softmax).

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_mla_decode.py -q   (CPU)
     python -m pytest tests/kernels/test_mla_decode.py -q                                (GPU)
"""

from __future__ import annotations

import pytest
import torch

from bench.inputs import paged_decode_inputs
from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.mla_decode import (
    DecodeTile,
    choose_num_kv_splits,
    default_decode_tile,
    mla_decode,
    mla_decode_ref,
)
from tests.kernels.conftest import (
    DEVICE,
    assert_close_to_ref,
    gpu,
    paged_req_to_token,
    requires_gpu,
    requires_triton,
)

pytestmark = requires_triton

LENS = [1, 37, 5, 16, 29, 2, 33]  # mixed, 1 included, not multiples of the 32-key tile


def _case(
    lens: list[int], H: int, kv_lora: int, rope: int, page_size: int,
    dtype: torch.dtype, device: str, seed: int,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    return tuple(paged_decode_inputs(lens, H, kv_lora, rope, page_size, dtype, device, gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("H", [3, 20])  # 20: a second, ragged block of 16 heads
def test_mla_decode_matches_ref(dtype: torch.dtype, page_size: int, H: int, poisoned_empty: None) -> None:
    kv_lora, rope = 24, 8
    q, kv, r2t, rows, seq_lens = _case(LENS, H, kv_lora, rope, page_size, dtype, DEVICE, seed=H + page_size)
    sm_scale = (kv_lora + rope) ** -0.5
    out = mla_decode(q, kv, r2t, rows, seq_lens, kv_lora, sm_scale)
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq_lens, kv_lora, sm_scale)
    assert out.shape == (len(LENS), H, kv_lora) and out.dtype == dtype
    assert_close_to_ref(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v_splits", [1, 2])
def test_one_split_writes_out_directly_same_bits(dtype: torch.dtype, v_splits: int, poisoned_empty: None) -> None:
    """One split: stage 1 stores the output itself (no merge). The merge of one split weighs it by exp2(0) = 1,
    so the two-stage twin (direct=False) must give the same bits; NaN-filled allocations catch a row or a
    value half left unwritten."""
    q, kv, r2t, rows, seq_lens = _case(LENS, 7, 40, 8, 3, dtype, DEVICE, seed=23 + v_splits)
    tile = DecodeTile(16, 16, 4, 2, v_splits=v_splits, direct=True)
    out = mla_decode(q, kv, r2t, rows, seq_lens, 40, 0.3, num_kv_splits=1, tile=tile)
    twin = mla_decode(q, kv, r2t, rows, seq_lens, 40, 0.3, num_kv_splits=1, tile=tile._replace(direct=False))
    assert not out.isnan().any()
    assert torch.equal(out, twin)
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq_lens, 40, 0.3)
    assert_close_to_ref(out, ref, dtype)


@pytest.mark.parametrize("num_kv_splits", [1, 5])  # 5: more splits than the short requests need
def test_mla_decode_fixed_splits(num_kv_splits: int, poisoned_empty: None) -> None:
    q, kv, r2t, rows, seq_lens = _case(LENS, 5, 24, 8, 3, torch.bfloat16, DEVICE, seed=num_kv_splits)
    out = mla_decode(q, kv, r2t, rows, seq_lens, 24, 0.25, num_kv_splits=num_kv_splits)
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq_lens, 24, 0.25)
    assert_close_to_ref(out, ref, torch.bfloat16)


def test_mla_decode_head_block_and_tile_knobs(poisoned_empty: None) -> None:
    """The tuning knobs bench sweeps (32 heads a program, 16-key tiles) compute the same function."""
    q, kv, r2t, rows, seq_lens = _case(LENS, 40, 24, 8, 2, torch.bfloat16, DEVICE, seed=7)
    out = mla_decode(q, kv, r2t, rows, seq_lens, 24, 0.2, num_kv_splits=3, tile=DecodeTile(32, 16, 4, 2))
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq_lens, 24, 0.2)
    assert_close_to_ref(out, ref, torch.bfloat16)


@pytest.mark.parametrize(
    "tile",
    [DecodeTile(16, 16, 4, 3, v_splits=2), DecodeTile(16, 32, 4, 2, keys_major=True),
     DecodeTile(32, 16, 4, 4, v_splits=2, keys_major=True)],
    ids=["v_splits+early_slots", "keys_major", "both+early_slots"],
)  # fmt: skip
@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_decode_split_and_transposed_tiles(tile: DecodeTile, page_size: int, poisoned_empty: None) -> None:
    """The H = 128 candidates (value columns split over two programs; scores as [keys, heads]) compute the
    same function: fresh data, 19 heads (a ragged head block), kv_lora 40 (not a power of two: each half
    of the 64 padded columns is masked differently), mixed lengths, splits that leave some empty; num_stages
    >= 3 takes the path that loads each tile's slots one iteration early."""
    q, kv, r2t, rows, seq_lens = _case(LENS, 19, 40, 8, page_size, torch.bfloat16, DEVICE, seed=page_size + 11)
    out = mla_decode(q, kv, r2t, rows, seq_lens, 40, 0.15, num_kv_splits=4, tile=tile)
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq_lens, 40, 0.15)
    assert_close_to_ref(out, ref, torch.bfloat16)


def test_choose_num_kv_splits() -> None:
    assert choose_num_kv_splits(batch=256, num_head_blocks=8, max_seq_len=32768, sm_count=132) == 1
    assert choose_num_kv_splits(batch=64, num_head_blocks=1, max_seq_len=32768, sm_count=132) == 17
    assert choose_num_kv_splits(batch=16, num_head_blocks=1, max_seq_len=32768, sm_count=132) == 64
    assert choose_num_kv_splits(batch=16, num_head_blocks=1, max_seq_len=300, sm_count=132) == 2
    assert choose_num_kv_splits(batch=1, num_head_blocks=1, max_seq_len=10**6, sm_count=1000) == 64
    assert choose_num_kv_splits(64, 1, 8192, 132, waves=4) == 9  # rounded up: a 0.36-wave tail
    assert choose_num_kv_splits(64, 1, 8192, 132, waves=4, whole_waves=True) == 8


def test_h16_default_splits_by_cost() -> None:
    """The H < 64 bf16 default's split count is the fastest measured on the H200 at all nine cells (B 16 / 64 / 256
    x 1K / 8K / 32K keys; BENCHMARKS.md, MLA decode): one wave of 2 programs per SM where it fits (B = 16: 8 x 128
    keys at 1k, 16 at 8k and 32k; B = 64: 4; B = 256: 1, one split and 256 programs)."""
    tile = default_decode_tile(16, torch.bfloat16)
    cells = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)]
    assert [tile.num_kv_splits(B, 16, L, 132) for B, L in cells] == [8, 16, 16, 4, 4, 4, 1, 1, 1]
    assert tile.num_kv_splits(1, 16, 300, 132) == 3  # >= 128 keys a split (min_split)
    assert tile.num_kv_splits(1, 16, 10**6, 132) == 64  # MAX_KV_SPLITS
    assert tile.num_kv_splits(20, 16, 8192, 132) == 13  # 260 programs: one wave of 264 slots


def test_narrow_default_splits_by_cost() -> None:
    """The narrow Gluon default: one program an SM, one wave of 128 programs at all nine cells (twice the splits
    measured slower on the H200 at B16/1k, B16/8k, B64/1k), >= 64 keys a split."""
    tile = default_decode_tile(16, torch.bfloat16, use_gluon=True, page_size=64)
    cells = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)]
    assert [tile.num_kv_splits(B, 16, L, 132) for B, L in cells] == [8, 8, 8, 2, 2, 2, 1, 1, 1]
    assert tile.num_kv_splits(1, 16, 300, 132) == 5  # >= 64 keys a split (min_split)
    assert tile.num_kv_splits(64, 16, 190, 132) == 2  # the 2.5B e2e step: 128 programs of 2 tiles


def test_gluon_default_splits_by_cost() -> None:
    """The H = 128 Gluon default's split count is the fastest measured on the H200 at all nine cells (BENCHMARKS.md,
    MLA decode: 4 splits at B = 16, 1 at B = 64 and 256), and fills idle
    SMs where one split leaves most of them empty (B = 48: 96 of 132 SMs; the model's 4 splits = 2.9 waves)."""
    tile = default_decode_tile(128, torch.bfloat16, use_gluon=True, kv_lora=512, rope=64)
    cells = [(B, L) for B in (16, 64, 256) for L in (1024, 8192, 32768)]
    assert [tile.num_kv_splits(B, 128, L, 132) for B, L in cells] == [4, 4, 4, 1, 1, 1, 1, 1, 1]
    assert tile.num_kv_splits(48, 128, 8192, 132) == 4
    assert tile.num_kv_splits(1, 128, 300, 132) == 2  # >= 256 keys a split (MIN_TOKENS_PER_SPLIT)
    assert tile.num_kv_splits(1, 128, 10**6, 132) == 64  # MAX_KV_SPLITS


def test_default_tile_takes_gluon_only_where_it_runs() -> None:
    """use_gluon (the engine sets it on Hopper) picks the Gluon stage 1 at H >= 64 (the seesaw one on 64-slot pages at
    rope 64, whose P lives in a tile's rope rows) and the narrow Gluon one below
    (on pages of a multiple of 64 slots: its TMA form), bf16/fp16, DeepSeek's latent; any other shape, dtype or
    page size keeps the Triton kernel (the tiny models' kv_lora 24 included)."""
    assert default_decode_tile(128, torch.bfloat16, use_gluon=True).kernel == "wide"  # page 1: cp.async rows
    assert default_decode_tile(128, torch.bfloat16, use_gluon=True, page_size=64).kernel == "seesaw"  # TMA tiles
    rope32 = default_decode_tile(128, torch.bfloat16, use_gluon=True, kv_lora=512, rope=32, page_size=64)
    assert rope32.kernel == "wide"
    assert default_decode_tile(128, torch.bfloat16).kernel == "triton"
    assert default_decode_tile(128, torch.bfloat16, use_gluon=True, kv_lora=24, rope=8).kernel == "triton"
    assert default_decode_tile(128, torch.float32, use_gluon=True).kernel == "triton"
    narrow = default_decode_tile(16, torch.bfloat16, use_gluon=True, page_size=64)
    assert (narrow.kernel, narrow.page_size, narrow.direct, narrow.cluster) == ("narrow", 64, True, 2)
    assert default_decode_tile(16, torch.float16, use_gluon=True, page_size=128).kernel == "narrow"
    assert default_decode_tile(16, torch.bfloat16, use_gluon=True, page_size=1).kernel == "triton"  # cp.async form
    assert default_decode_tile(16, torch.bfloat16, use_gluon=True, kv_lora=24, rope=8).kernel == "triton"
    assert default_decode_tile(16, torch.float32, use_gluon=True).kernel == "triton"
    assert default_decode_tile(16, torch.bfloat16).kernel == "triton"


def test_gluon_tile_carries_page_size_and_tma_form_needs_it() -> None:
    """The Gluon tile takes the caller's page size (the TMA form needs whole 64-key tiles on consecutive
    rows: pages of a multiple of 64), and tma_usable (host logic, no GPU) also wants q contiguous as [B H, C]
    and 16-byte cache rows."""
    from r3trace.kernels.mla_decode import latent_tiles as mg

    assert default_decode_tile(128, torch.bfloat16, use_gluon=True, page_size=64).page_size == 64
    assert default_decode_tile(128, torch.bfloat16, use_gluon=True).page_size == 1
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(3, 16, 576, generator=gen).bfloat16(), torch.randn(640, 576, generator=gen).bfloat16()
    assert [mg.tma_usable(q, kv, p) for p in (1, 16, 32, 64, 128, 96)] == [False] * 3 + [True, True, False]
    assert not mg.tma_usable(q.transpose(0, 1).contiguous().transpose(0, 1), kv, 64)  # heads-major q
    wide = torch.randn(640, 580, generator=gen).bfloat16()
    assert not mg.tma_usable(q, wide[:, :576], 64)  # 1160 B rows: not 16-aligned


def test_mla_decode_rejects_bad_arguments() -> None:
    q, kv, r2t, rows, seq_lens = _case([3, 4], 2, 24, 8, 1, torch.float32, DEVICE, seed=0)
    with pytest.raises(KernelInputError, match="kv_cache row"):
        mla_decode(q, kv[:, :30], r2t, rows, seq_lens, 24, 0.2)
    with pytest.raises(KernelInputError, match="dtype"):
        mla_decode(q, kv.half(), r2t, rows, seq_lens, 24, 0.2)
    with pytest.raises(KernelInputError, match="seq_lens"):
        mla_decode(q, kv, r2t, rows, seq_lens[:1], 24, 0.2)
    with pytest.raises(KernelInputError, match="value splits"):  # 16 columns split in two: below a dot's K
        mla_decode(q[..., 8:], kv[:, 8:], r2t, rows, seq_lens, 16, 0.2, tile=DecodeTile(16, 16, 4, 2, 2))


@gpu
@requires_gpu
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_decode_deepseek_shape_gpu(H: int, page_size: int) -> None:
    """DeepSeek's latent (512 + 64) at lengths that split many ways, bf16, on the GPU."""
    lens = [1, 700, 3001, 64, 1500]
    q, kv, r2t, rows, seq_lens = _case(lens, H, 512, 64, page_size, torch.bfloat16, "cuda", seed=H)
    out = mla_decode(q, kv, r2t, rows, seq_lens, 512, 576**-0.5)
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq_lens, 512, 576**-0.5)
    assert_close_to_ref(out, ref, torch.bfloat16)


@gpu
@requires_gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("page_size", [1, 64])
def test_pdl_under_cuda_graph_same_bits(pdl: bool, page_size: int) -> None:
    """Programmatic dependent launch (DecodeTile.pdl: stage 1 and the merge start before the kernel ahead of them
    ends and wait before their first global access) gives the same bits as the plain launch, eagerly and
    replayed from a CUDA graph on new lengths and new cache contents (the engine decodes from graphs); three
    calls captured back to back, so each stage 1 overwrites partials right after a merge read them. Lengths end
    mid-tile; 7 splits leave some empty. pdl=False: the plain launch under the same graph replay."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("griddepcontrol needs sm_90+")
    gen = torch.Generator().manual_seed(page_size + pdl)
    r2t, rows, S = paged_req_to_token([3000] * 5, page_size, gen)
    q = torch.randn(5, 16, 576, generator=gen).cuda().bfloat16()
    kv = torch.randn(S, 576, generator=gen).cuda().bfloat16()
    seq = torch.tensor([900, 17, 2100, 1, 3000], device="cuda")
    r2t, rows = r2t.cuda(), rows.cuda()
    plain = default_decode_tile(16, torch.bfloat16)._replace(pdl=False)
    tile = plain._replace(pdl=pdl)
    args = (q, kv, r2t, rows, seq, 512, 0.05, 7)
    assert torch.equal(mla_decode(*args, tile=tile), mla_decode(*args, tile=plain))  # also compiles both
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [mla_decode(*args, tile=tile) for _ in range(3)]
    seq.copy_(torch.tensor([1, 2049, 64, 3000, 333]))
    kv.copy_(torch.randn(S, 576, generator=gen).bfloat16())
    graph.replay()
    eager = mla_decode(*args, tile=plain)
    for out in outs:
        assert torch.equal(out, eager)
    ref = mla_decode_ref(q.float(), kv.float(), r2t, rows, seq, 512, 0.05)
    assert_close_to_ref(eager, ref, torch.bfloat16)
