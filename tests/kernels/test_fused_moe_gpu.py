"""fused_moe on the GPU only: the end-to-end model's shape, DeepSeek-like tiers, TMA descriptors, pointer loads,
fp32 through descriptors, the gemv tiles and their cache hints, CUDA-graph replay without host syncs. The CPU
interpreter cases are in test_fused_moe.py.

Run: python -m pytest tests/kernels/test_fused_moe_gpu.py -q -m gpu   (GPU)
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.moe.config import GEMV_T1, SHORT_D_DOWN, SHORT_D_DOWN_BM32
from r3trace.kernels.moe.fused_moe import GemmTile, MoeConfig, fused_moe, fused_moe_ref, moe_config
from tests.kernels.conftest import assert_close_to_ref, gpu, requires_gpu, requires_triton
from tests.kernels.moe_cases import moe_case as _moe_case
from tests.kernels.moe_cases import routes as _routes
from tests.kernels.test_fused_moe import with_shared

pytestmark = requires_triton


@gpu
@requires_gpu
@pytest.mark.parametrize("S", [0, 2], ids=["k6", "shared2"])
@pytest.mark.parametrize("T", [16, 64, 128, 256])
def test_fused_moe_e2e_shape_gpu(T: int, S: int) -> None:
    """The end-to-end model's MoE (D = 2048, E = 64, I = 512, K = 6; S = 2: the engine's real shape, its 2 shared
    experts fused as rows 64, 65 on every token with weight 1, so 66 rows and 8 pairs a token) on its default
    (short-D tiles, align_tile's launch; BLOCK_M 32 from T = 128; pdl) against the reference; pdl off gives the same
    bits (the same kernels in the same order), and the default replayed from a CUDA graph too."""
    hidden, w13, w2, ids, weights = _moe_case(T, 2048, 64 + S, 512, 6, torch.bfloat16, "cuda", seed=T + S)
    if S:
        routed = _routes(T, 64, 6, torch.Generator().manual_seed(T)).cuda()  # [T, 6] of the 64 routed experts
        ids, weights = with_shared(routed, weights, 64, S)
    K = 6 + S
    cfg = moe_config(T * K, 64 + S, 2, 512, tokens=T, hidden=2048)
    assert cfg.pdl and cfg.down == (SHORT_D_DOWN if cfg.block_m == 16 else SHORT_D_DOWN_BM32)
    out = fused_moe(hidden, w13, w2, ids, weights)
    assert torch.equal(out, fused_moe(hidden, w13, w2, ids, weights, config=cfg))
    assert_close_to_ref(out, fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights), torch.bfloat16)
    assert torch.equal(fused_moe(hidden, w13, w2, ids, weights, config=cfg._replace(pdl=False)), out)
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        replayed = fused_moe(hidden, w13, w2, ids, weights, config=cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)


@gpu
@requires_gpu
@pytest.mark.parametrize("T", [1, 200, 700, 3000])  # each of moe_config's four tile tiers at E=32, K=8
def test_fused_moe_deepseek_like_gpu(T: int) -> None:
    hidden, w13, w2, ids, weights = _moe_case(T, 1024, 32, 256, 8, torch.bfloat16, "cuda", seed=T)
    out = fused_moe(hidden, w13, w2, ids, weights)
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert_close_to_ref(out, ref, torch.bfloat16)


# the large-T variants on the GPU (real TMA descriptors, wgmma): BLOCK_M 128 at E = 32 (T = 3000: ~660 rows per
# expert, 6 blocks, the last partly padding), the interleaved [1, BN, 2, BK] box reshaped for one product, the
# two-product gate_up, pointer loads, and the whole-K (I = 256) split down
GPU_TMA = {
    "il-tma": MoeConfig(128, GemmTile(128, 64, 8, 8, 3, True, tma=True), GemmTile(256, 64, 8, 8, 3, tma=True)),
    "plain-tma": MoeConfig(128, GemmTile(128, 64, 8, 8, 3, tma=True), GemmTile(256, 64, 8, 8, 4, tma=True)),
    "il-pointers": MoeConfig(128, GemmTile(128, 64, 8, 8, 3, True), GemmTile(256, 64, 8, 8, 3)),
    "split-tma": MoeConfig(128, GemmTile(128, 64, 8, 8, 3, True, tma=True),
                           GemmTile(64, 256, 8, 8, 3, n_split=4, tma=True)),
    # the bf16 I <= 256 default at 32-63 rows per expert: BLOCK_M 64, TMA weights, whole-K down
    "bm64-split-tma": MoeConfig(64, GemmTile(128, 64, 8, 8, 3, True, tma=True),
                                GemmTile(64, 256, 8, 8, 3, n_split=4, tma=True)),
}  # fmt: skip


@gpu
@requires_gpu
@pytest.mark.parametrize("name", list(GPU_TMA))
def test_fused_moe_tma_gpu(name: str) -> None:
    hidden, w13, w2, ids, weights = _moe_case(3000, 1024, 32, 256, 8, torch.bfloat16, "cuda", seed=4)
    out = fused_moe(hidden, w13, w2, ids, weights, config=GPU_TMA[name])
    ref = fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights)
    assert_close_to_ref(out, ref, torch.bfloat16)


@gpu
@requires_gpu
def test_fused_moe_default_fp32_large_t_gpu() -> None:
    """fp32 on the default BLOCK_M 128 tiles (TMA weights at BLOCK_K 32; ~370 rows per expert here)."""
    hidden, w13, w2, ids, weights = _moe_case(800, 512, 16, 384, 8, torch.float32, "cuda", seed=2)
    assert moe_config(800 * 8, 16, 4, 384, tokens=800).gate_up.tma
    out = fused_moe(hidden, w13, w2, ids, weights)
    assert_close_to_ref(out, fused_moe_ref(hidden, w13, w2, ids, weights), torch.float32)


@gpu
@requires_gpu
def test_fused_moe_tma_fp32_gpu() -> None:
    """fp32 through the descriptors (ieee dots, no wgmma): D = 200, I = 72 are not tile multiples."""
    hidden, w13, w2, ids, weights = _moe_case(300, 200, 8, 72, 4, torch.float32, "cuda", seed=6)
    cfg = MoeConfig(64, GemmTile(32, 32, 4, 4, 2, True, tma=True), GemmTile(64, 32, 4, 4, 2, tma=True))
    out = fused_moe(hidden, w13, w2, ids, weights, config=cfg)
    assert_close_to_ref(out, fused_moe_ref(hidden, w13, w2, ids, weights), torch.float32)


GPU_GEMV = moe_config(8, 256, 2, 256, tokens=1)
GPU_GEMV_WIDE = moe_config(8, 32, 2, 2048, tokens=1)  # the default at I = 2048: 1 row, 1 warp per down program
# the T = 1 tile without and with each evict_first hint: a cache hint moves no value, so each must match the ref
GPU_GEMV_HINTS = {
    f"gemv-evict-{int(up)}{int(down)}": GPU_GEMV._replace(
        gemv=GEMV_T1._replace(up_evict_first=up, down_evict_first=down))
    for up, down in ((False, False), (True, False), (False, True))
}  # fmt: skip
GPU_GEMVS = {"gemv": GPU_GEMV, "gemv-wide": GPU_GEMV_WIDE, **GPU_GEMV_HINTS}


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
@pytest.mark.parametrize("config", [None, GPU_GEMV, GPU_GEMV_WIDE], ids=["default", "gemv", "gemv-wide"])
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
