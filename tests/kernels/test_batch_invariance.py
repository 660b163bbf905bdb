"""Row invariance of every piece batch_invariant=True runs (EngineConfig.batch_invariant): a row computed in batches
of 1, 3 and 17 rows has the full batch's bits, for the GEMM (linear and per-head forms), the fixed-split MLA decode,
the fused MoE's invariant plan, the router logits at every T, the grouped top-k, RMSNorm and RoPE; and the GEMM and
the decode against their torch twins.

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_batch_invariance.py -q   (CPU)
     python -m pytest tests/kernels/test_batch_invariance.py -q                                 (GPU, compiled)

Peer: SGLang's batch-invariant matmul fixes one tile config per dtype for every M
(sgl-project/sglang python/sglang/srt/batch_invariant_ops/batch_invariant_ops.py at d40bdca0) and its deterministic
Triton decode a 256-key split size (python/sglang/srt/environ.py at 21ff4b08); these tests check the property those
choices exist for, on this project's kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from r3trace.kernels.invariant_matmul import (
    NARROW_BLOCK_K,
    SMEM_BYTES,
    TILES,
    WIDE_M,
    WIDE_TILES,
    MatmulTile,
    invariant_bmm,
    invariant_bmm_ref,
    invariant_linear,
    matmul_tile,
)
from r3trace.kernels.mla_decode.fixed_split import FixedSplitDecoder, fixed_split_decoder
from r3trace.kernels.mla_decode.reference import mla_decode_ref
from r3trace.kernels.moe.registry import MoeShape, resolve_moe
from r3trace.kernels.rmsnorm import rmsnorm
from r3trace.kernels.rope import rope
from r3trace.kernels.router_logits import logits_parts, logits_tile, router_logits
from r3trace.kernels.topk import grouped_topk
from tests.kernels.conftest import DEVICE, assert_close_to_ref, requires_triton
from tests.kernels.moe_cases import moe_case

pytestmark = requires_triton
ROWS = 37  # an odd batch; its rows are recomputed in batches of 1, 3 and 17 (the last batch of each is short)
DTYPES = [torch.float32, torch.bfloat16]


def assert_rows_invariant(fn: Callable[[slice], torch.Tensor], rows: int = ROWS) -> None:
    """fn(rows slice) -> that slice's output [n, ...]: each batching's concatenation has the full batch's bits."""
    full = fn(slice(0, rows))
    for size in (1, 3, 17):
        parts = torch.cat([fn(slice(s, min(s + size, rows))) for s in range(0, rows, size)])
        assert torch.equal(parts, full), f"rows in batches of {size} differ from the batch of {rows}"


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_rows_invariant_and_close_to_torch(dtype: torch.dtype) -> None:
    """[37, 130] x [70, 130]^T (K and N not multiples of any tile). Against the fp32 torch twin rounded once to the
    dtype: the kernel accumulates the same exact products in fp32 in another order, so the results differ by the fp32
    order (fp32 row of conftest.TOLERANCES) or one rounding to bf16 (its bf16 row)."""
    x, w = randn(ROWS, 130, dtype=dtype, seed=1), randn(70, 130, dtype=dtype, seed=2)
    assert_rows_invariant(lambda r: invariant_linear(x[r], w))
    assert_close_to_ref(invariant_linear(x, w), invariant_bmm_ref(x[None], w.t()[None])[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_head_gemm_through_strided_views(dtype: torch.dtype) -> None:
    """The absorbed MLA's form: x [T, H, In] and out [T, H, Out] as transposed views (no copies), w [H, In, Out]."""
    h, d_in, d_out = 3, 40, 72
    x, w = randn(ROWS, h, d_in, dtype=dtype, seed=3), randn(h, d_in, d_out, dtype=dtype, seed=4)

    def heads(r: slice) -> torch.Tensor:
        out = torch.full((x[r].shape[0], h, d_out + 5), float("nan"), dtype=dtype, device=DEVICE)[..., :d_out]
        invariant_bmm(x[r].transpose(0, 1), w, out=out.transpose(0, 1))
        return out

    assert_rows_invariant(heads)
    assert_close_to_ref(heads(slice(0, ROWS)), invariant_bmm_ref(x.transpose(0, 1), w).transpose(0, 1), dtype)


def test_gemm_tile_rule() -> None:
    """matmul_tile: BLOCK_M by M, the widest BLOCK_N giving MIN_PROGRAMS programs (16 at the fewest), the stages cut
    to the shared-memory bound, WIDE_TILES from WIDE_M rows; fp32 and the interpreter one tile at every M."""
    bf16 = torch.bfloat16
    assert matmul_tile(bf16, 1, 2048) == MatmulTile(16, 16, NARROW_BLOCK_K, 4, 4)  # 128 programs only at BLOCK_N 16
    assert matmul_tile(bf16, 64, 32000) == MatmulTile(64, 128, NARROW_BLOCK_K, 4, 4)  # 250 programs
    assert matmul_tile(bf16, 33, 16384).block_n == 128 and matmul_tile(bf16, 33, 8192).block_n == 64
    assert matmul_tile(bf16, 64, 512, g=16).block_n == 64  # the per-head form counts G x tiles
    assert matmul_tile(bf16, 20, 576) == MatmulTile(32, 16, NARROW_BLOCK_K, 4, 4)
    assert matmul_tile(bf16, WIDE_M - 1, 2048).block_m == 64 and matmul_tile(bf16, WIDE_M, 2048) == WIDE_TILES[bf16]
    for t in (matmul_tile(bf16, m, n) for m in (1, 64, 300) for n in (16, 2048, 32000)):
        assert (t.block_m + t.block_n) * t.block_k * 2 * t.num_stages <= SMEM_BYTES
    assert {matmul_tile(torch.float32, m, 2048) for m in (1, 64, 4096)} == {TILES[torch.float32]}
    assert {matmul_tile(bf16, m, 2048, compiled=False) for m in (1, 64, 4096)} == {TILES[bf16]}


def block_rows(dec: FixedSplitDecoder, q: torch.Tensor, kv: torch.Tensor, r2t: torch.Tensor, pool_row: int,
               keys: torch.Tensor, sizes: list[int], max_len: int, kv_lora: int = 64) -> torch.Tensor:
    """Rows q [n] of one request (row t sees keys[t] keys) computed in ONE call as len(sizes) requests of sizes[i]
    consecutive rows: sizes [n] is a prefill chunk, [1] * n n decode rows, [4] * k verifies of 4 rows."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    as_t = lambda v: torch.tensor(v, device=DEVICE)  # noqa: E731
    return dec(q, kv, r2t, as_t([pool_row] * len(sizes)), as_t(starts), as_t(sizes), keys, kv_lora, 0.1, max_len,
               max(sizes))  # fmt: skip


def chunkings(n: int) -> list[list[int]]:
    """Ways to cut n rows into requests: decode rows, verifies of 2 and 4, odd chunks, and offset ones (the rows land
    in other slots of a program's token block)."""
    return [[1] * n, *([k] * (n // k) + [n % k] * (n % k > 0) for k in (2, 4, 5)), [2, n - 2]]


# fp32 (12-14 s each) is in the slow set: bf16 at first key 40 runs the same splits off a tile boundary
@pytest.mark.parametrize(("dtype", "first_key"), [pytest.param(torch.float32, 0, marks=pytest.mark.slow),
                                                  pytest.param(torch.float32, 40, marks=pytest.mark.slow),
                                                  (torch.bfloat16, 40)], ids=str)  # fmt: skip
def test_fixed_split_rows_invariant(dtype: torch.dtype, first_key: int) -> None:
    """5 heads (8-head, 8-token blocks), kv_lora 64 + rope 16, 64-key splits; 37 consecutive query rows of one
    request whose keys run first_key + 1 .. first_key + 37 (40: every row crosses the first split's end). Each row's
    bits are the same as one prefill chunk, as decode rows, as verifies of 2 and 4 rows, in chunks of 5 and in an
    offset chunk (rows in other slots of a block), each chunking in one call or in one call a request, under any grid
    bound; and close to mla_decode_ref."""
    h, kvl, c = 5, 64, 80
    kv = randn(2000, c, dtype=dtype, seed=5)
    r2t = torch.randperm(2000, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.int32).view(2, 1000)
    q = randn(ROWS, h, c, dtype=dtype, seed=7 + first_key)
    keys = torch.arange(first_key + 1, first_key + ROWS + 1, device=DEVICE)
    dec = fixed_split_decoder(h, dtype, split_keys=64)
    assert dec.tile.heads * dec.tile.tokens == 64 and dec.tile.tokens == 8
    full = block_rows(dec, q, kv, r2t, 1, keys, [ROWS], 100)
    for sizes in chunkings(ROWS):
        assert torch.equal(block_rows(dec, q, kv, r2t, 1, keys, sizes, 1000), full), f"one call of {sizes}"
    s0 = 0
    for n in (3, 17, 17):  # one call a request: a request alone in its batch, one of 17 rows starts mid-block
        assert torch.equal(block_rows(dec, q[s0 : s0 + n], kv, r2t, 1, keys[s0 : s0 + n], [n], 100), full[s0 : s0 + n])
        s0 += n
    pool = torch.ones(ROWS, dtype=torch.int64, device=DEVICE)
    assert_close_to_ref(full, mla_decode_ref(q, kv, r2t, pool, keys, kvl, 0.1), dtype)


def test_fixed_split_requests_do_not_mix() -> None:
    """Two requests on different cache rows in one call (rows interleaved in blocks of 3 and 2): each gets its own
    keys: equal to each computed alone, and a changed key of one request moves none of the other's bits."""
    h, kvl, c = 2, 64, 80
    kv = randn(2000, c, dtype=torch.float32, seed=20)
    r2t = torch.randperm(2000, generator=torch.Generator().manual_seed(21)).to(DEVICE, torch.int32).view(2, 1000)
    q = randn(5, h, c, dtype=torch.float32, seed=22)
    keys = torch.tensor([70, 71, 72, 300, 301], device=DEVICE)
    dec = fixed_split_decoder(h, torch.float32, split_keys=64)
    as_t = lambda v: torch.tensor(v, device=DEVICE)  # noqa: E731
    both = dec(q, kv, r2t, as_t([0, 1]), as_t([0, 3]), as_t([3, 2]), keys, kvl, 0.1, 301, 3)
    assert torch.equal(both[:3], block_rows(dec, q[:3], kv, r2t, 0, keys[:3], [3], 72))
    assert torch.equal(both[3:], block_rows(dec, q[3:], kv, r2t, 1, keys[3:], [2], 301))
    kv2 = kv.clone()
    kv2[r2t[1, 5].long()] += 1.0  # a key of request 1 only
    moved = dec(q, kv2, r2t, as_t([0, 1]), as_t([0, 3]), as_t([3, 2]), keys, kvl, 0.1, 301, 3)
    assert torch.equal(moved[:3], both[:3]) and not torch.equal(moved[3:], both[3:])


# I = 520 (the short-D tiles) only on the GPU: the CPU interpreter runs one tile at every T, which I = 136 covers, and
# its I = 520 cases took 74 s of the CI suite; fp32 at I = 136 (22 s) is in the slow set: the same tiles as bf16's
@pytest.mark.parametrize(("dtype", "inter"), [
    pytest.param(d, i, id=f"{d}-I{i}", marks=[pytest.mark.gpu] if i == 520 else [pytest.mark.slow] if d == torch.float32
                 else []) for d in DTYPES for i in (136, 520)])
def test_moe_invariant_plan_rows(dtype: torch.dtype, inter: int) -> None:
    """The invariant plan (resolve_moe(invariant=True)) never takes gemv and runs the default plan's tiles, whose
    BLOCK_M and BLOCK_K follow T: 140 tokens on 4 experts, top-2, D = 264 (K steps of every BLOCK_K, the last short),
    recomputed in batches of `small` and 40 tokens. Compiled in bf16, I = 136 (the down's whole-K tile): BLOCK_M 16 /
    32 / 128 at 8.5 / 20 / 70 rows per expert, gate_up BLOCK_K 256 then 64; I = 520 (the short-D tiles): BLOCK_M 16 /
    32 / 64 at 3.5 / 20 / 70 rows, (gate_up, down) BLOCK_K (256, 128), (128, 128), (64, 64). Each token has the same
    bits in every batching and alone (the default plan's gemv size)."""
    rows, small = 140, (17 if inter < 512 else 7)
    hidden, w13, w2, ids, weights = moe_case(rows, 264, 4, inter, 2, dtype, DEVICE, seed=9)
    plan = resolve_moe(MoeShape(264, inter), dtype, invariant=True)
    compiled = DEVICE == "cuda"
    cfgs = [plan.config(n, 2 * n, 4, compiled) for n in (small, 40, rows)]
    crossing = compiled and dtype == torch.bfloat16
    expect = ((16, 32, 128) if inter < 512 else (16, 32, 64)) if crossing else (cfgs[0].block_m,) * 3
    assert plan.gemv is None and tuple(c.block_m for c in cfgs) == expect
    block_ks = {(c.gate_up.block_k, c.down.block_k) for c in cfgs}
    assert len(block_ks) == ((2 if inter < 512 else 3) if crossing else 1), block_ks
    moe = lambda r: plan(hidden[r], w13, w2, ids[r], weights[r])  # noqa: E731
    full = moe(slice(0, rows))
    for size in (small, 40):
        parts = torch.cat([moe(slice(s, s + size)) for s in range(0, rows, size)])
        assert torch.equal(parts, full), f"batches of {size}"
    for t in (0, 69, rows - 1):
        assert torch.equal(moe(slice(t, t + 1)), full[t : t + 1]), f"token {t} alone"


def test_gemm_wide_tile_rows() -> None:
    """bf16 [WIDE_M + 88, 300] x [300, 200]: compiled, the full product runs WIDE_TILES' tile (BLOCK_K 64: 5 steps,
    the last short), batches of 37 rows a 64 x 16 x 128 tile and single rows 16 x 16 x 128 (3 steps); every row has
    the same bits, as the K steps accumulate in order whatever the tile. The interpreter runs TILES' at every M
    (matmul_tile says why)."""
    rows = WIDE_M + 88
    x, w = randn(rows, 300, dtype=torch.bfloat16, seed=23), randn(200, 300, dtype=torch.bfloat16, seed=24)
    compiled = DEVICE == "cuda"
    tiles = {matmul_tile(torch.bfloat16, m, 200, compiled=compiled) for m in (rows, 37, 1)}
    assert len(tiles) == (3 if compiled else 1) and len({t.block_k for t in tiles}) == (2 if compiled else 1)
    full = invariant_linear(x, w)
    assert torch.equal(torch.cat([invariant_linear(x[s : s + 37], w) for s in range(0, rows, 37)]), full)
    for t in (0, 300, rows - 1):
        assert torch.equal(invariant_linear(x[t : t + 1], w), full[t : t + 1]), f"row {t} alone"


# D = 256 and 2048 on the GPU only: the interpreter runs the narrow tile at every T, so they would test there what
# D = 96 does, and D = 256's 608 programs a call at T = 300 (E = 256) took 336 s of the suite on the 2-core machine
@pytest.mark.parametrize("d", [96, pytest.param(256, marks=pytest.mark.gpu), pytest.param(2048, marks=pytest.mark.gpu)])
def test_router_logits_at_every_t(d: int) -> None:
    """torch_above=None: the kernel at T = 300 (above its default torch fallback at 256), rows as at T = 1..17,
    across the tile ladder's rungs (router_logits.logits_tile; asserted below): D = 96, E = 16 stays on the narrow
    tile, D = 256, E = 256 (2 parts) takes [16, 64] at T = 300, D = 2048 (16 parts) [16, 32] up to T = 3, [16, 64]
    at 17 and [128, 64] x BLOCK_K 32 at 300.
    fp32 FMAs in order over each slice make the tile irrelevant to a row's bits. The interpreter runs the narrow tile
    at every T (logits_tile says why)."""
    e = 16 if d == 96 else 256
    x, w = randn(300, d, dtype=torch.bfloat16, seed=10), randn(e, d, dtype=torch.float32, seed=11)
    parts = logits_parts(d)[1]
    compiled = DEVICE == "cuda"
    tiles = {logits_tile(t, e, parts, compiled=compiled) for t in (1, 3, 17, 300)}
    assert len(tiles) == ({96: 1, 256: 2, 2048: 3}[d] if compiled else 1), tiles
    assert_rows_invariant(lambda r: router_logits(x[r], w, torch_above=None).sum(0), rows=300)


def test_topk_norm_rope_rows_invariant() -> None:
    """grouped top-k (ids and weights), RMSNorm (with the residual add) and RoPE: one program a row (or 16 rows of
    independent lanes), so a row's bits never depend on the batch."""
    logits = randn(ROWS, 32, dtype=torch.float32, seed=12)
    bias = randn(32, dtype=torch.float32, seed=13)

    def topk(r: slice) -> torch.Tensor:
        w, ids = grouped_topk(logits[r], bias, 4, "sigmoid", "noaux_tc", 4, 2, True, 2.5)
        return torch.cat([w, ids.float()], dim=1)

    assert_rows_invariant(topk)
    x, res = randn(ROWS, 100, dtype=torch.bfloat16, seed=14), randn(ROWS, 100, dtype=torch.bfloat16, seed=15)
    weight = randn(100, dtype=torch.bfloat16, seed=16)
    assert_rows_invariant(lambda r: torch.cat(rmsnorm(x[r], weight, 1e-6, res[r]), dim=1))
    q = randn(ROWS, 3, 16, dtype=torch.bfloat16, seed=17)
    pos = torch.randint(0, 64, (ROWS,), generator=torch.Generator().manual_seed(18)).to(DEVICE)
    ang = torch.arange(64.0)[:, None] * torch.rand(8, generator=torch.Generator().manual_seed(19))[None]
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    assert_rows_invariant(lambda r: rope(q[r], pos[r], cos, sin))
