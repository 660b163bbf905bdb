"""fused_moe (align + two grouped GEMMs + sum) against fused_moe_ref (per-expert torch loop).

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_fused_moe.py -q   (CPU)
     python -m pytest tests/kernels/test_fused_moe.py -q                                (GPU)
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.fused_moe import (
    GemmTile,
    GemvTile,
    MoeConfig,
    fused_moe,
    fused_moe_ref,
    grouped_config,
    moe_config,
    same_tiles,
)
from r3trace.kernels.moe_config import GEMV_T1
from tests.kernels.conftest import DEVICE, assert_close_to_ref, gpu, requires_gpu, requires_triton

pytestmark = requires_triton


def _routes(T: int, E: int, K: int, gen: torch.Generator, empty: tuple[int, ...] = ()) -> torch.Tensor:
    """Distinct experts per token (as a top-k gives), never the experts in `empty`, some ids -1."""
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(T)])
    off_rank = torch.rand(T, K, generator=gen) < 0.15  # experts on another EP rank
    return torch.where(off_rank, -1, ids).to(torch.int32)


def _moe_case(
    T: int, D: int, E: int, I: int, K: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=gen).to(device, dtype)
    w13 = (torch.randn(E, 2 * I, D, generator=gen) / D**0.5).to(device, dtype)
    w2 = (torch.randn(E, D, I, generator=gen) / I**0.5).to(device, dtype)
    ids = _routes(T, E, K, gen, empty=(2,)).to(device)
    weights = torch.rand(T, K, generator=gen).to(device)
    return hidden, w13, w2, ids, weights


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
        same_tiles(32, 32, 16, 2, 4, 2),
        same_tiles(16, 16, 32, 1, 4, 2),
        MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(64, 32, 4, 4, 2)),
        MoeConfig(32, GemmTile(16, 32, 2, 4, 2, True), GemmTile(32, 16, 1, 4, 2)),
        MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2, n_split=3)),
    ],
    ids=["bm32-bk16", "bm16-bk32", "bm16-down-apart", "bm32-interleaved", "bm16-down-n-split"],
)
def test_fused_moe_tile_configs(config: MoeConfig, poisoned_empty: None) -> None:
    """Tiles that divide D (EVEN_K) and tiles that don't, several M blocks per expert, grouped order,
    gate_up and down tiled apart (down's BLOCK_K 32 does not divide I = 20), gate and up weights
    interleaved into one product (I = 20 over BLOCK_N 16: a masked second tile), down with the whole
    K = I = 20 in one masked tile and 3 programs per block walking D = 64's four N tiles unevenly."""
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
    "gemv": MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2), GemvTile(8, 16, 4, 16, 16, 4)),
    "gemv-2-rows": MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2), GemvTile(2, 32, 1, 4, 8, 2)),
    # the lanes kernels unrolled (D = 40 over 16: three steps, the last masked; the down's K = 3 experts
    # x I = 24 over 16: six steps, every second masked; over 32: three one-step experts)
    "gemv-unrolled": MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2),
                               GemvTile(8, 16, 4, 16, 16, 4, unroll=True)),
    "gemv-unrolled-2": MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2),
                                 GemvTile(2, 32, 1, 4, 32, 2, unroll=True)),
    # weight loads hinted evict_first (an L2 policy compiled; the interpreter traces the argument only)
    "gemv-evict-first": MoeConfig(16, GemmTile(32, 16, 2, 4, 2), GemmTile(16, 32, 2, 4, 2),
                                  GemvTile(2, 32, 1, 4, 32, 2, unroll=True, up_evict_first=True,
                                           down_evict_first=True)),
}  # fmt: skip


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T, E", [(1, 256), (3, 33), (17, 8)])
def test_fused_moe_paths_match_ref(T: int, E: int, dtype: torch.dtype, path: str, poisoned_empty: None) -> None:
    """grouped and gemv (BLOCK_K 16 and 32 over D = 40: a masked last step; I = 24 over 16 and 8 rows of
    w13, D = 40 over 16 and 4 rows of w2: masked last tiles; the down's K = I = 24 over 16 and 8), against
    the reference; ids of -1 and an empty expert as in every case here; T = 3 and 17 share experts."""
    hidden, w13, w2, ids, weights = _moe_case(T, 40, E, 24, 3, dtype, DEVICE, seed=T + E)
    out = fused_moe(hidden, w13, w2, ids, weights, config=PATHS[path])
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert out.shape == hidden.shape and out.dtype == dtype
    assert_close_to_ref(out, ref, dtype)


def test_fused_moe_gemv_moves_fp32_by_summation_order_only() -> None:
    """fp32, ieee dots: gemv against grouped differs by the reordered sums alone (a few ulps)."""
    hidden, w13, w2, ids, weights = _moe_case(17, 40, 8, 24, 3, torch.float32, DEVICE, seed=7)
    plain = fused_moe(hidden, w13, w2, ids, weights, config=PATHS["grouped"])
    gemv = fused_moe(hidden, w13, w2, ids, weights, config=PATHS["gemv"])
    rel = ((gemv.double() - plain.double()).norm() / plain.double().norm()).item()
    assert rel < 1e-6, f"gemv moved the fp32 output by {rel:.1e} (a few ulps expected)"


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


@gpu
@requires_gpu
@pytest.mark.parametrize("T", [1, 200, 700, 3000])  # each of moe_config's four tile tiers at E=32, K=8
def test_fused_moe_deepseek_like_gpu(T: int) -> None:
    hidden, w13, w2, ids, weights = _moe_case(T, 1024, 32, 256, 8, torch.bfloat16, "cuda", seed=T)
    out = fused_moe(hidden, w13, w2, ids, weights)
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert_close_to_ref(out, ref, torch.bfloat16)


GPU_GEMV = moe_config(8, 256, 2, 256, tokens=1)
GPU_GEMV_LOOP = GPU_GEMV._replace(gemv=GemvTile(4, 1024, 4, 4, 256, 4))  # the runtime loops (before session 3)
GPU_GEMV_WIDE = moe_config(8, 32, 2, 2048, tokens=1)  # the default at I = 2048: 1 row, 1 warp per down program
# the T = 1 tile without and with each evict_first hint: a cache hint moves no value, so each must match the ref
GPU_GEMV_HINTS = {
    f"gemv-evict-{int(up)}{int(down)}": GPU_GEMV._replace(
        gemv=GEMV_T1._replace(up_evict_first=up, down_evict_first=down))
    for up, down in ((False, False), (True, False), (False, True))
}  # fmt: skip
GPU_GEMVS = {"gemv": GPU_GEMV, "gemv-loop": GPU_GEMV_LOOP, "gemv-wide": GPU_GEMV_WIDE, **GPU_GEMV_HINTS}


@gpu
@requires_gpu
@pytest.mark.parametrize("config", list(GPU_GEMVS.values()), ids=list(GPU_GEMVS))
@pytest.mark.parametrize("T", [1, 5])
def test_fused_moe_gemv_gpu(T: int, config: MoeConfig) -> None:
    hidden, w13, w2, ids, weights = _moe_case(T, 1024, 32, 256, 8, torch.bfloat16, "cuda", seed=T)
    out = fused_moe(hidden, w13, w2, ids, weights, config=config)
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert_close_to_ref(out, ref, torch.bfloat16)


@gpu
@requires_gpu
@pytest.mark.parametrize("config", [None, GPU_GEMV, GPU_GEMV_LOOP], ids=["default", "gemv", "gemv-loop"])
@pytest.mark.parametrize("T", [1, 64])
def test_fused_moe_cuda_graph_no_sync_gpu(T: int, config: MoeConfig | None) -> None:
    """No host sync (sync-debug mode raises on one), and a captured graph replayed on new routes
    written in place gives what eager gives on them: the block count is read on the device."""
    hidden, w13, w2, ids, weights = _moe_case(T, 1024, 256, 128, 8, torch.bfloat16, "cuda", seed=T)
    fused_moe(hidden, w13, w2, ids, weights, config=config)  # compile outside capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(hidden, w13, w2, ids, weights, config=config)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = fused_moe(hidden, w13, w2, ids, weights, config=config)
    new_ids = _routes(T, 256, 8, torch.Generator().manual_seed(99)).cuda()
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(hidden, w13, w2, ids, weights, config=config))
