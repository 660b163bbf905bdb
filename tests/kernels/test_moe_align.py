"""moe_align (Triton) against moe_align_ref (torch): same sorted pairs, padding, block experts, rows used.

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_moe_align.py -q   (CPU)
     python -m pytest tests/kernels/test_moe_align.py -q                                (GPU)

Integer outputs: compared exactly (no tolerance). Each case draws fresh routes from its own seed.
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.moe.align import MoeAlignment, align_capacity, moe_align, moe_align_ref
from r3trace.kernels.moe.config import AlignTile, align_tile
from tests.kernels.conftest import DEVICE, requires_triton

pytestmark = requires_triton


def _ids(T: int, E: int, K: int, seed: int, off_rank: float = 0.15) -> torch.Tensor:
    """[T, K] distinct experts per token (as a top-k gives), a share of them -1 (another EP rank)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return torch.where(torch.rand(T, K, generator=gen) < off_rank, -1, ids).to(torch.int32)


def _assert_same(a: MoeAlignment, r: MoeAlignment, ids: torch.Tensor, E: int, block_m: int) -> None:
    flat = ids.reshape(-1).cpu()
    M = flat.numel()
    used = int(r.num_padded.item())
    assert int(a.num_padded.item()) == used and used % block_m == 0
    assert a.sorted_ids.shape == r.sorted_ids.shape and a.block_expert.shape == r.block_expert.shape
    got, want = a.sorted_ids[:used].cpu(), r.sorted_ids[:used].cpu()
    blocks = a.block_expert.cpu()
    for e in range(E):  # per expert the same set of pairs (the brief's check), then the exact layout
        mine = got[torch.repeat_interleave(blocks[: used // block_m] == e, block_m)]
        assert set(mine[mine < M].tolist()) == set(torch.nonzero(flat == e).reshape(-1).tolist()), e
    assert torch.equal(got, want), "same order: pairs of an expert in increasing pair index, padding = M"
    assert torch.equal(blocks, r.block_expert.cpu())
    assert (blocks[used // block_m :] == -1).all()
    for blk in range(used // block_m):  # no block of padding only, one expert per block
        pairs = got[blk * block_m : (blk + 1) * block_m].long()
        pairs = pairs[pairs < M]
        assert len(pairs) > 0 and (flat[pairs] == int(blocks[blk])).all()


CASES = [  # (T, E, K, block_m): T in 1, 3, 17, 200 x E in 8, 33, 256, K over 1..8, BLOCK_M 1..128
    (1, 8, 8, 16), (1, 33, 1, 16), (1, 256, 8, 16),
    (3, 8, 2, 4), (3, 33, 5, 64), (3, 256, 3, 16),
    (17, 8, 6, 1), (17, 33, 7, 32), (17, 256, 4, 128),
    (200, 8, 1, 16), (200, 33, 8, 64), (200, 256, 6, 64),
]  # fmt: skip


@pytest.mark.parametrize(("T", "E", "K", "block_m"), CASES)
def test_moe_align_matches_ref(T: int, E: int, K: int, block_m: int, poisoned_empty: None) -> None:
    ids = _ids(T, E, K, seed=1000 * T + 10 * E + K).to(DEVICE)
    _assert_same(moe_align(ids, E, block_m), moe_align_ref(ids, E, block_m), ids, E, block_m)


@pytest.mark.parametrize(("T", "E", "K", "chunk"), [(17, 33, 7, 5), (200, 8, 3, 37), (64, 256, 8, 64)])
def test_moe_align_many_chunks(T: int, E: int, K: int, chunk: int, poisoned_empty: None) -> None:
    """The two-launch path: chunk sizes that split experts' pairs across programs, odd and not."""
    ids = _ids(T, E, K, seed=T + E + chunk).to(DEVICE)
    _assert_same(moe_align(ids, E, 16, chunk=chunk), moe_align_ref(ids, E, 16), ids, E, 16)


def test_moe_align_all_off_rank_and_skewed(poisoned_empty: None) -> None:
    ids = torch.full((5, 4), -1, dtype=torch.int32, device=DEVICE)
    a = moe_align(ids, 8, 16)
    assert int(a.num_padded.item()) == 0 and (a.block_expert.cpu() == -1).all()
    skewed = torch.zeros(40, 1, dtype=torch.int32, device=DEVICE) + 3  # one expert, several blocks
    skewed[::7] = 5
    _assert_same(moe_align(skewed, 8, 16, chunk=9), moe_align_ref(skewed, 8, 16), skewed, 8, 16)
    int64 = _ids(9, 33, 4, seed=3).long().to(DEVICE)
    _assert_same(moe_align(int64, 33, 16), moe_align_ref(int64, 33, 16), int64, 33, 16)


def test_align_capacity_bounds_the_rows_used() -> None:
    for T, E, K, bm in CASES:
        ids = _ids(T, E, K, seed=T * E, off_rank=0.0)
        counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
        assert int(((counts + bm - 1) // bm * bm).sum()) <= align_capacity(T * K, E, bm)


def test_moe_align_rejects_bad_arguments() -> None:
    ids = _ids(4, 8, 2, seed=0).to(DEVICE)
    with pytest.raises(KernelInputError, match="topk_ids dtype"):
        moe_align(ids.float(), 8, 16)
    with pytest.raises(KernelInputError, match="num_experts"):
        moe_align(ids, 0, 16)
    with pytest.raises(KernelInputError, match="contiguous"):
        moe_align(ids.repeat(2, 1)[::2], 8, 16)  # rows strided: the kernel reads the ids flat


# Launch shapes (kernels/moe/config.py AlignTile): one [M, E] one-hot tile counting and ranking at once,
# narrower tiles, fewer warps, 64- and 37-pair chunk programs; odd E (33: BLOCK_E 64 with 31 masked columns), ids of
# -1 (15%), experts with no pairs (E = 256 with 17 x 4 pairs leaves most empty), pairs of one expert split across
# chunks. Integer outputs: exact.
TILES = [AlignTile(512, 0, 0, 4), AlignTile(0, 32, 0, 2), AlignTile(0, 64, 64, 4), AlignTile(0, 16, 37, 1),
         AlignTile(0, 32, 32, 8)]  # fmt: skip


@pytest.mark.parametrize("tile", TILES, ids=[str(tuple(t)) for t in TILES])
@pytest.mark.parametrize(
    ("T", "E", "K", "block_m"), [(1, 8, 8, 16), (17, 256, 4, 16), (23, 33, 6, 32), (50, 64, 6, 16)]
)
def test_moe_align_launch_shapes(T: int, E: int, K: int, block_m: int, tile: AlignTile, poisoned_empty: None) -> None:
    ids = _ids(T, E, K, seed=7 * T + E + tile.chunk).to(DEVICE)
    _assert_same(moe_align(ids, E, block_m, tile=tile, pdl=True), moe_align_ref(ids, E, block_m), ids, E, block_m)


def test_align_tile_default_by_pairs_and_experts(poisoned_empty: None) -> None:
    """align_tile: AlignTile() (the large-M launch) above 2048 pairs or 256 experts; else one tile up to 8192 one-hot
    ints, 32-pair chunks beyond. Both picks give the reference's alignment at E = 64, K = 6 (the end-to-end
    model's routed experts) and at the engine's real shape: 66 rows, the 2 shared experts (64, 65) on every token,
    so each of them fills several blocks while most routed ones fill one."""
    assert align_tile(2049, 64) == AlignTile() and align_tile(64, 257) == AlignTile()
    assert align_tile(96, 64) == AlignTile(128, 32, 32, 4) and align_tile(384, 256) == AlignTile(32, 32, 32, 4)
    for T in (16, 64):  # 96 pairs: one tile; 384: twelve chunk programs
        ids = _ids(T, 64, 6, seed=T, off_rank=0.05).to(DEVICE)
        tile = align_tile(T * 6, 64)
        _assert_same(moe_align(ids, 64, 16, tile=tile), moe_align_ref(ids, 64, 16), ids, 64, 16)
    for T in (5, 37):  # 40 pairs: one [40, 128] tile; 296 pairs: 10 chunk programs (the last one 8 pairs)
        shared = torch.tensor([[64, 65]], dtype=torch.int32).expand(T, 2)
        ids = torch.cat([_ids(T, 64, 6, seed=3 * T, off_rank=0.05), shared], dim=1).to(DEVICE)  # [T, 8]
        tile = align_tile(T * 8, 66)
        assert (tile.one_tile_pairs >= T * 8) == (T == 5)
        _assert_same(moe_align(ids, 66, 16, tile=tile), moe_align_ref(ids, 66, 16), ids, 66, 16)
