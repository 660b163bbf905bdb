"""The Gluon stage 1s (narrow: 16-head blocks; gluon: 64-head blocks over two warpgroups) with their splits merged
inside a thread-block cluster (DecodeTile(cluster=P), kernels/cluster_merge.py) against mla_decode_ref and against the
same kernel with the merge launch. Hopper only:
     python -m pytest tests/kernels/test_cluster_merge.py -q -m gpu
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.mla_decode import DecodeTile, mla_decode, mla_decode_ref
from r3trace.kernels.mla_decode.tile import CLUSTER_SIZES
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

CLUSTERED = DecodeTile(16, 64, 4, 2, kernel="narrow", page_size=64, cluster=8)  # every cluster size
WIDE = DecodeTile(64, 64, 8, 2, kernel="wide", page_size=64, cluster=8)
# 1 and 33 keys leave every split but the first empty at 2-8 splits (a 64-key split each): those ranks still take
# part in the barriers and weigh nothing; 3001 and 130 give splits of unequal tile counts. Five requests: at 8
# splits even 3 head blocks (15 clusters of 8) fit on an H200 at once (15 do), so every case takes the clusters
LENS = [1, 700, 3001, 33, 130]


hopper_only = pytest.mark.skipif(not HOPPER, reason="thread-block clusters and the narrow kernel are sm_90")


def _inputs(H: int, kv_lora: int, rope: int, page_size: int, seed: int, lens: list[int] = LENS) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    r2t, rows, S = paged_req_to_token(lens, page_size, gen)
    q = torch.randn(len(lens), H, kv_lora + rope, generator=gen).cuda().bfloat16()
    kv = torch.randn(S, kv_lora + rope, generator=gen).cuda().bfloat16()
    return q, kv, r2t.cuda(), rows.cuda(), torch.tensor(lens, device="cuda")


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each cluster launch returned (False: the clusters would not fit at once; the merge kernel ran)."""
    from r3trace.kernels.mla_decode import narrow as mla_decode_narrow
    from r3trace.kernels.mla_decode import wide as mla_decode_gluon

    seen: list[bool] = []
    for mod in (mla_decode_narrow, mla_decode_gluon):
        launch = mod.launch_in_clusters
        monkeypatch.setattr(mod, "launch_in_clusters", lambda *a, _f=launch: seen.append(_f(*a)) or seen[-1])
    return seen


SHAPES = {  # (tile, H, kv_lora, rope)
    "narrow-H16": (CLUSTERED, 16, 512, 64),
    "narrow-H40": (CLUSTERED, 40, 512, 64),  # three head blocks, the last one's heads 40-47 masked at the store
    "narrow-kv256-rope32": (CLUSTERED, 16, 256, 32),  # 8 ranks own 32 output columns each
    # the engine tests' latent: a 45 KB kernel, the exchange inside it
    "narrow-kv128-rope16": (CLUSTERED, 16, 128, 16),
    "wide-H128": (WIDE, 128, 512, 64),  # two 64-head blocks, each its own clusters
    "wide-H80-kv128-rope16": (WIDE, 80, 128, 16),  # the second block's heads 80-127 masked
}


@hopper_only
@pytest.mark.parametrize("page_size", [64, 1], ids=["tma", "rows"])
@pytest.mark.parametrize("splits", CLUSTER_SIZES)
@pytest.mark.parametrize(("tile", "H", "kv_lora", "rope"), list(SHAPES.values()), ids=list(SHAPES))
def test_cluster_merge_matches_ref(
    tile: DecodeTile, H: int, kv_lora: int, rope: int, splits: int, page_size: int, launches: list[bool]
) -> None:  # fmt: skip
    """Within the bf16 table of the fp32 reference, and within a bf16 ulp or two of the merge kernel: both weigh the
    same fp32 split sums; the cluster scales unnormalised sums once, the merge kernel normalised partials, so the
    fp32 results differ in their last bits and the bf16 outputs by at most a rounding step (2e-2 at |out| < 2)."""
    q, kv, r2t, rows, seq = _inputs(H, kv_lora, rope, page_size, splits + H + page_size)
    scale = (kv_lora + rope) ** -0.5
    tile = tile._replace(page_size=page_size)
    out = mla_decode(q, kv, r2t, rows, seq, kv_lora, scale, num_kv_splits=splits, tile=tile)
    assert launches == [True]
    assert_close_to_ref(out, mla_decode_ref(q.float(), kv.float(), r2t, rows, seq, kv_lora, scale), torch.bfloat16)
    merged = mla_decode(q, kv, r2t, rows, seq, kv_lora, scale, num_kv_splits=splits, tile=tile._replace(cluster=0))
    torch.testing.assert_close(out.float(), merged.float(), atol=2e-2, rtol=2e-2)


@hopper_only
def test_clusters_that_do_not_fit_take_the_merge_kernel(launches: list[bool]) -> None:
    """40 clusters of 8 CTAs (one an SM) cannot all be resident on a GPU of 132 SMs: the launcher declines and the
    call goes through the partials and the merge, the same bits as without the option."""
    q, kv, r2t, rows, seq = _inputs(16, 512, 64, 64, 6, lens=[300 + 37 * i for i in range(40)])
    args = (q, kv, r2t, rows, seq, 512, 576**-0.5, 8)
    assert torch.equal(mla_decode(*args, tile=CLUSTERED), mla_decode(*args, tile=CLUSTERED._replace(cluster=0)))
    assert launches == [False]


@hopper_only
def test_other_split_counts_take_the_merge_kernel() -> None:
    """3 splits is no cluster size: the call goes through the partials and the merge, the same bits as without the
    option."""
    q, kv, r2t, rows, seq = _inputs(16, 512, 64, 64, 5)
    args = (q, kv, r2t, rows, seq, 512, 576**-0.5, 3)
    assert torch.equal(mla_decode(*args, tile=CLUSTERED), mla_decode(*args, tile=CLUSTERED._replace(cluster=0)))


@hopper_only
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize(("tile", "heads"), [(CLUSTERED, 16), (WIDE, 128)], ids=["narrow", "wide"])
def test_cluster_merge_under_cuda_graph(tile: DecodeTile, heads: int, pdl: bool, launches: list[bool]) -> None:
    """4 splits as clusters of 4, captured and replayed on new lengths and cache contents, equals eager; with and
    without programmatic dependent launch (both launch attributes on one cuLaunchKernelEx)."""
    assert_graph_replay_matches_eager(tile._replace(pdl=pdl), heads)
    assert launches == [True] * 3  # warm-up, capture, eager


@hopper_only
def test_cluster_merge_is_repeatable() -> None:
    """The merge order is fixed (ranks 0..P-1 in turn): two calls give the same bits."""
    q, kv, r2t, rows, seq = _inputs(16, 512, 64, 64, 8)
    args = (q, kv, r2t, rows, seq, 512, 576**-0.5, 8)
    assert torch.equal(mla_decode(*args, tile=CLUSTERED), mla_decode(*args, tile=CLUSTERED))
