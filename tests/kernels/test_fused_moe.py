"""fused_moe (align + two grouped GEMMs + sum) against fused_moe_ref (per-expert torch loop).

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_fused_moe.py -q   (CPU)
     python -m pytest tests/kernels/test_fused_moe.py -q                                (GPU)
The GPU-only cases (real TMA descriptors, wgmma, CUDA graphs, the engine's shapes) are in test_fused_moe_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.moe.config import (
    SHORT_D_DOWN,
    SHORT_D_DOWN_BM32,
    SHORT_D_UP_BM16,
    SHORT_D_UP_BM32,
    SHORT_D_UP_FEW,
    align_tile,
)
from r3trace.kernels.moe.fused_moe import (
    AlignTile,
    GemmTile,
    GemvTile,
    MoeConfig,
    fused_moe,
    fused_moe_ref,
    grouped_config,
    moe_config,
)
from tests.kernels.conftest import DEVICE, assert_close_to_ref, requires_triton
from tests.kernels.moe_cases import moe_case as _moe_case
from tests.kernels.moe_cases import routes as _routes

pytestmark = requires_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("T", [1, 13])
def test_fused_moe_matches_ref(dtype: torch.dtype, T: int, poisoned_empty: None) -> None:
    hidden, w13, w2, ids, weights = _moe_case(T, 40, 6, 24, 3, dtype, DEVICE, seed=T)  # D, I not pow2
    out = fused_moe(hidden, w13, w2, ids, weights)
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert out.shape == hidden.shape and out.dtype == dtype
    assert_close_to_ref(out, ref, dtype)
    # the torch align twin gives the same sorted pairs, so the same GEMM programs: bitwise equal
    assert torch.equal(fused_moe(hidden, w13, w2, ids, weights, align="ref"), out)


@pytest.mark.parametrize(
    "config",
    [
        MoeConfig(32, GemmTile(32, 16, 2, 4, 2), GemmTile(32, 16, 2, 4, 2)),
        MoeConfig(16, GemmTile(16, 32, 1, 4, 2), GemmTile(16, 32, 1, 4, 2)),
        MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(64, 32, 4, 4, 2)),
        MoeConfig(32, GemmTile(16, 32, 2, 4, 2, True), GemmTile(32, 16, 1, 4, 2)),
        MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2, n_split=3)),
        MoeConfig(32, GemmTile(16, 32, 2, 4, 2, True, tma=True), GemmTile(32, 16, 1, 4, 2, tma=True)),
    ],
    ids=["bm32-bk16", "bm16-bk32", "bm16-down-apart", "bm32-interleaved", "bm16-down-n-split", "bm32-tma-unaligned"],
)
def test_fused_moe_tile_configs(config: MoeConfig, poisoned_empty: None) -> None:
    """Tiles that divide D (EVEN_K) and tiles that don't, several M blocks per expert, grouped order,
    gate_up and down tiled apart (down's BLOCK_K 32 does not divide I = 20), gate and up weights
    interleaved into one product (I = 20 over BLOCK_N 16: a masked second tile), down with the whole
    K = I = 20 in one masked tile and 3 programs per block walking D = 64's four N tiles unevenly; TMA asked
    for where only w13's rows (64 x 2 B) are 16-byte multiples: the gate_up takes it, the down (w2 rows and act
    rows of 20 x 2 B) keeps its pointer loads."""
    hidden, w13, w2, ids, weights = _moe_case(50, 64, 5, 20, 2, torch.bfloat16, DEVICE, seed=5)
    out = fused_moe(hidden, w13, w2, ids, weights, config=config)
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert_close_to_ref(out, ref, torch.bfloat16)


# Both paths on odd shapes, each forced. Tolerances: the conftest table (output roundings dominate). The
# gemv path changes the fp32 summation order (each dot product over D in BLOCK_K lanes reduced by a tree
# at the end instead of BLOCK_K-wide MMA steps; the K experts of a token summed in fp32 in one program)
# and skips one rounding (y [M, D] is never stored in the activation dtype). Reordering a D = 40 fp32 sum
# moves it by a few ulps (2^-24 relative each): ~1e-7 of values up to ~3 here (seen: max 7e-7 at T = 17),
# far below the fp32 row (1e-4) and 1e4 times below a bf16 ulp; in bf16 gemv lands closer to the fp32
# reference than grouped (max error 0.023 vs 0.038 at T = 17 in the interpreter).
PATHS = {
    "grouped": MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2, n_split=3)),
    # the lanes kernels, unrolled (D = 40 over 16: three steps, the last masked; the down's K = 3 experts x I = 24
    # over 16: six steps, every second masked; over 8: nine; over 32: three one-step experts)
    "gemv": MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2), GemvTile(8, 16, 4, 16, 16, 4)),
    "gemv-2-rows": MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2), GemvTile(2, 32, 1, 4, 8, 2)),
    "gemv-2": MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2), GemvTile(2, 32, 1, 4, 32, 2)),
    # weight loads hinted evict_first (an L2 policy compiled; the interpreter traces the argument only)
    "gemv-evict-first": MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2),
                                  GemvTile(2, 32, 1, 4, 32, 2, up_evict_first=True, down_evict_first=True)),
    # weights through TMA descriptors: D = 40 and I = 24 rows are 16-byte multiples in bf16 and fp32, so every
    # descriptor is taken; boxes past D = 40 (BK 16: the third step) and I = 24 (BN 16: the second tile) read
    # zeros or the next expert's rows
    "tma-interleaved": MoeConfig(16, GemmTile(16, 16, 2, 4, 2, True, tma=True), GemmTile(16, 16, 2, 4, 2, tma=True)),
    "tma-plain-split": MoeConfig(32, GemmTile(16, 16, 2, 4, 2, tma=True),
                                 GemmTile(16, 32, 2, 4, 2, n_split=2, tma=True)),
}  # fmt: skip


# gemv-evict-first differs from gemv-2 only in a cache hint the interpreter ignores, so its T = 17 cases (about 12 s
# each in the interpreter, the slowest kernel tests of the CPU suite) are marked slow: `make test-all` runs them. So
# are gemv-2's and gemv-2-rows' bf16 cases at T = 17 (19 and 30 s): their fp32 twins run the same programs, and
# T = 1 and 3 keep bf16 on every path
PATH_CASES = [
    pytest.param(T, E, dtype, path, id=f"{T}-{E}-{dtype}-{path}",
                 marks=[pytest.mark.slow] if T == 17 and (path == "gemv-evict-first" or (
                     dtype == torch.bfloat16 and path in ("gemv-2", "gemv-2-rows"))) else [])
    for T, E in [(1, 256), (3, 33), (17, 8)] for dtype in (torch.float32, torch.bfloat16) for path in PATHS
]


@pytest.mark.parametrize("T, E, dtype, path", PATH_CASES)
def test_fused_moe_paths_match_ref(T: int, E: int, dtype: torch.dtype, path: str, poisoned_empty: None) -> None:
    """grouped and gemv (BLOCK_K 16 and 32 over D = 40: a masked last step; I = 24 over 16 and 8 rows of
    w13, D = 40 over 16 and 4 rows of w2: masked last tiles; the down's K = I = 24 over 16 and 8), against
    the reference; ids of -1 and an empty expert as in every case here; T = 3 and 17 share experts."""
    hidden, w13, w2, ids, weights = _moe_case(T, 40, E, 24, 3, dtype, DEVICE, seed=T + E)
    out = fused_moe(hidden, w13, w2, ids, weights, config=PATHS[path])
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert out.shape == hidden.shape and out.dtype == dtype
    assert_close_to_ref(out, ref, dtype)


# The short-D tiles, scaled to the interpreter: gate_up at BLOCK_M 16 (plain) or 32 (interleaved, TMA), the
# TMA down, the align launches of align_tile (one tile; 8-pair chunks), pdl asked for (a no-op without sm_90: the
# same kernels run). D = 40 / I = 24 rows are 16-byte multiples: every descriptor is taken; the down's BLOCK_N 32
# over D = 40 leaves a second tile mostly past the end (read as zeros / the next expert's rows, not stored).
SHORT_D = {
    "bm16": MoeConfig(16, GemmTile(32, 32, 1, 4, 3), GemmTile(32, 16, 1, 4, 3, tma=True),
                      align=AlignTile(512, 64, 64, 4)),
    "bm32-il-tma": MoeConfig(32, GemmTile(16, 16, 1, 4, 3, True, tma=True), GemmTile(32, 16, 1, 4, 3, tma=True),
                             align=AlignTile(0, 16, 8, 4)),
    "bm32-pdl": MoeConfig(32, GemmTile(16, 16, 1, 4, 3, True, tma=True), GemmTile(32, 16, 1, 4, 3, tma=True),
                          align=AlignTile(0, 16, 8, 4), pdl=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SHORT_D))
@pytest.mark.parametrize("T, E", [(3, 33), (17, 8)])
def test_fused_moe_short_d_paths_match_ref(T: int, E: int, name: str, poisoned_empty: None) -> None:
    """bf16 (the tiles' dtype) against the reference: the conftest's bf16 row; expert 2 never routed, 15% ids -1."""
    hidden, w13, w2, ids, weights = _moe_case(T, 40, E, 24, 3, torch.bfloat16, DEVICE, seed=3 * T + E)
    out = fused_moe(hidden, w13, w2, ids, weights, config=SHORT_D[name])
    assert_close_to_ref(out, fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights), torch.bfloat16)
    assert torch.equal(fused_moe(hidden, w13, w2, ids, weights, config=SHORT_D[name], align="ref"), out)


def test_moe_config_short_d_tiles_by_hidden() -> None:
    """A pure function of the shapes: D <= 4096 with I >= 512 in bf16 below 64 rows per expert takes the short-D
    tiles; D = 7168, D unknown (0), I = 256 or fp32 keep the general tiers (align_tile's launch in all of them)."""
    short = moe_config(64 * 6, 64, 2, 512, tokens=64, hidden=2048)
    assert short.block_m == 16 and short.down == SHORT_D_DOWN and short.align == align_tile(384, 64)
    assert short.gate_up == SHORT_D_UP_FEW  # 6 rows per expert
    assert moe_config(256 * 6, 64, 2, 512, tokens=256, hidden=2048)[:3] == (32, SHORT_D_UP_BM32, SHORT_D_DOWN_BM32)
    # the engine's real shape (2 shared experts fused: 66 rows, 8 pairs a token): 3.9 rows at T = 32, 7.8 at T = 64
    assert moe_config(32 * 8, 66, 2, 512, tokens=32, hidden=2048)[:3] == (16, SHORT_D_UP_FEW, SHORT_D_DOWN)
    assert moe_config(64 * 8, 66, 2, 512, tokens=64, hidden=2048)[:3] == (16, SHORT_D_UP_BM16, SHORT_D_DOWN)
    for hidden, inter, itemsize in ((7168, 512, 2), (0, 512, 2), (2048, 256, 2), (2048, 512, 4)):
        cfg = moe_config(384, 64, itemsize, inter, tokens=64, hidden=hidden)
        assert cfg[:3] == grouped_config(384, 64, itemsize, inter)[:3] and cfg.down != SHORT_D_DOWN


def with_shared(ids: torch.Tensor, weights: torch.Tensor, first: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's fused shared experts (engine/layers/moe.py): ids first..first+S-1 after every token's routed
    ones, weight 1.0. [T, K], [T, K] -> [T, K + S], [T, K + S]."""
    T = ids.shape[0]
    shared = torch.arange(first, first + S, dtype=ids.dtype, device=ids.device).expand(T, S)
    ones = torch.ones(T, S, dtype=weights.dtype, device=weights.device)
    return torch.cat([ids, shared], dim=1), torch.cat([weights, ones], dim=1)


# Shared-expert tiles at the interpreter's scale on the real shape's routes: 8 routed experts (K = 3) + 2 shared rows
# on every token, so the shared experts fill several BLOCK_M blocks (T = 37: 3 at BLOCK_M 16) while the routed
# ones fill about one. BLOCK_M 16 with the 2-stage TMA gate_up (BLOCK_N 16 over I = 24: a masked second tile),
# BLOCK_M 32 with the 2-stage TMA down; 32- and 8-pair align chunks (T = 37: 185 pairs, 6 and 24 chunk programs)
SHARED = {
    "bm16-up-s2": MoeConfig(16, GemmTile(16, 32, 1, 4, 2, tma=True), GemmTile(32, 16, 1, 4, 3, tma=True),
                            align=AlignTile(0, 32, 32, 4), pdl=True),
    "bm32-down-s2": MoeConfig(32, GemmTile(16, 16, 1, 4, 3, True, tma=True), GemmTile(32, 16, 1, 4, 2, tma=True),
                              align=AlignTile(0, 8, 8, 4), pdl=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SHARED))
@pytest.mark.parametrize("T", [5, 37])
def test_fused_moe_shared_rows_match_ref(T: int, name: str, poisoned_empty: None) -> None:
    """bf16 against the reference (the conftest's bf16 row); routed ids of -1 (15%), expert 2 never routed."""
    hidden, w13, w2, _, weights = _moe_case(T, 40, 10, 24, 3, torch.bfloat16, DEVICE, seed=5 * T + len(name))
    routed = _routes(T, 8, 3, torch.Generator().manual_seed(T), empty=(2,)).to(DEVICE)
    ids, weights = with_shared(routed, weights, 8, 2)
    out = fused_moe(hidden, w13, w2, ids, weights, config=SHARED[name])
    assert_close_to_ref(out, fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights), torch.bfloat16)
    assert torch.equal(fused_moe(hidden, w13, w2, ids, weights, config=SHARED[name], align="ref"), out)


def test_fused_moe_gemv_moves_fp32_by_summation_order_only() -> None:
    """fp32, ieee dots: gemv against grouped differs by the reordered sums alone (a few ulps)."""
    hidden, w13, w2, ids, weights = _moe_case(17, 40, 8, 24, 3, torch.float32, DEVICE, seed=7)
    plain = fused_moe(hidden, w13, w2, ids, weights, config=PATHS["grouped"])
    gemv = fused_moe(hidden, w13, w2, ids, weights, config=PATHS["gemv"])
    rel = ((gemv.double() - plain.double()).norm() / plain.double().norm()).item()
    assert rel < 1e-6, f"gemv moved the fp32 output by {rel:.1e} (a few ulps expected)"


# Each TMA variant against the pointer-load twin with the same tiles: the same K steps on the same
# values. Not always the same bits: a TMA weight tile is a transposed view, and the interpreter's numpy product
# can take another BLAS path for it (seen: the whole-K down, BK 32, 4.8e-5 relative on one fp32 element, 1.2e-7
# normwise; the other three twins equal bit for bit). So: fp32 within a few ulps normwise (1e-6; a wrong row,
# column or K step is O(1)), bf16 within one rounding step (2^-7 relative) per element.
TWINS = {
    "tma": ("tma-interleaved", MoeConfig(16, GemmTile(16, 16, 2, 4, 2, True), GemmTile(16, 16, 2, 4, 2))),
    "tma-plain-split": ("tma-plain-split",
                        MoeConfig(32, GemmTile(16, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2, n_split=2))),
}  # fmt: skip


@pytest.mark.skipif(DEVICE != "cpu", reason="near-bitwise twins in the interpreter; on the GPU: against the reference")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("twin", list(TWINS))
def test_fused_moe_tma_matches_pointer_twin(twin: str, dtype: torch.dtype, poisoned_empty: None) -> None:
    hidden, w13, w2, ids, weights = _moe_case(19, 40, 7, 24, 3, dtype, DEVICE, seed=11)
    path, plain = TWINS[twin]
    out = fused_moe(hidden, w13, w2, ids, weights, config=PATHS[path]).double()
    ref = fused_moe(hidden, w13, w2, ids, weights, config=plain).double()
    assert not torch.isnan(out).any()
    assert ((out - ref).norm() / ref.norm()).item() < (1e-6 if dtype == torch.float32 else 2**-7)
    assert ((out - ref).abs() <= 2**-7 * ref.abs() + 1e-6).all()


def test_moe_config_picks_gemv_at_few_tokens_only() -> None:
    for tokens in (1, 2, 4):
        assert moe_config(8 * tokens, 256, 2, 256, tokens=tokens).gemv is not None
    assert moe_config(8, 32, 2, 2048, tokens=1).gemv is not None
    assert moe_config(16, 32, 2, 2048, tokens=2).gemv is None  # I = 2048 at T = 2: grouped was faster
    for tokens in (0, 5, 16):
        assert moe_config(8 * max(tokens, 1), 256, 2, 256, tokens=tokens).gemv is None
    assert moe_config(16, 256, 2, 256, tokens=2)[:3] == grouped_config(16, 256, 2, 256)[:3]


@pytest.mark.parametrize("T", [1, 4])  # T = 1: the default gemv path
def test_fused_moe_all_ids_off_rank_gives_zeros(T: int) -> None:
    hidden, w13, w2, ids, weights = _moe_case(T, 40, 6, 24, 3, torch.float32, DEVICE, seed=0)
    out = fused_moe(hidden, w13, w2, torch.full_like(ids, -1), weights)
    assert torch.equal(out, torch.zeros_like(out))


def test_fused_moe_rejects_bad_arguments() -> None:
    hidden, w13, w2, ids, weights = _moe_case(4, 40, 6, 24, 3, torch.float32, DEVICE, seed=0)
    with pytest.raises(KernelInputError, match="w2 shape"):
        fused_moe(hidden, w13, w2[:, :, :10].contiguous(), ids, weights)
    with pytest.raises(KernelInputError, match="topk_ids dtype"):
        fused_moe(hidden, w13, w2, ids.long(), weights)
    with pytest.raises(KernelInputError, match="w13 dtype"):
        fused_moe(hidden, w13.half(), w2, ids, weights)
    with pytest.raises(KernelInputError, match="align"):
        fused_moe(hidden, w13, w2, ids, weights, align="torch")  # type: ignore[arg-type]


def test_whole_k_bf16_tiers_take_tma_weights_from_32_rows() -> None:
    """bf16 at I <= 256 (E = 256 / I = 256 under TP8): BLOCK_M 16 / 32 below 32 rows per expert, BLOCK_M 64 with TMA
    weights at 32-63 rows, 128 with TMA from 64 on (fastest on the H200: BENCHMARKS.md, Fused MoE); fp32 and
    I > 256 keep their tiers."""
    tiers = {T: moe_config(8 * T, 256, 2, 256, tokens=T) for T in (256, 512, 1024, 2040, 2048, 4096)}
    assert [c.block_m for c in tiers.values()] == [16, 32, 64, 64, 128, 128]
    assert not tiers[512].gate_up.tma and not tiers[512].down.tma
    for T in (1024, 2040, 2048, 4096):
        assert tiers[T].gate_up.tma and tiers[T].down.tma and tiers[T].down.n_split == 4
    assert moe_config(8 * 1024, 256, 4, 256, tokens=1024).block_m == 32  # fp32: BLOCK_M 32, no TMA
    assert not moe_config(8 * 1024, 256, 4, 256, tokens=1024).gate_up.tma
    assert moe_config(8 * 2048, 32, 2, 2048, tokens=2048).block_m == 128  # I = 2048: 512 rows, unchanged
    e32 = moe_config(8 * 256, 32, 2, 2048, tokens=256)  # 64 rows at I = 2048: BLOCK_M 64 without TMA, unchanged
    assert e32.block_m == 64 and not e32.gate_up.tma
