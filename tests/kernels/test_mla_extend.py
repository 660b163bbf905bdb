"""mla_extend (absorbed, over the paged cache) and mha_prefill (normal form) against their torch refs.

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_mla_extend.py -q   (CPU)
     python -m pytest tests/kernels/test_mla_extend.py -q                                (GPU)
"""

from __future__ import annotations

import pytest
import torch

from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.mha_prefill import mha_prefill, mha_prefill_ref
from r3trace.kernels.mla_extend import mla_extend, mla_extend_ref
from tests.kernels.conftest import (
    DEVICE,
    assert_close_to_ref,
    gpu,
    paged_req_to_token,
    requires_gpu,
    requires_triton,
)

pytestmark = requires_triton

# (prefix, extend) per request: no prefix, a 1-token extend, one longer than the 32-row tile, none at all
PREFIX = [0, 5, 17, 2, 9]
EXTEND = [7, 1, 40, 0, 3]


def _extend_case(
    prefix: list[int], extend: list[int], H: int, kv_lora: int, rope: int, page_size: int,
    dtype: torch.dtype, device: str, seed: int,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    req_to_token, rows, S = paged_req_to_token([max(n, 1) for n in lens], page_size, gen)
    T = sum(extend)
    C = kv_lora + rope
    q = torch.randn(T, H, C, generator=gen).to(device, dtype)
    kv = torch.randn(S, C, generator=gen).to(device, dtype)
    ext = torch.tensor(extend, dtype=torch.int64)
    meta = [torch.tensor(prefix), ext, torch.cumsum(ext, 0) - ext]
    return (q, kv, req_to_token.to(device), rows.to(device), *(m.to(device) for m in meta))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [1, 3])
def test_mla_extend_matches_ref(dtype: torch.dtype, page_size: int, poisoned_empty: None) -> None:
    kv_lora, rope, H = 24, 8, 3
    args = _extend_case(PREFIX, EXTEND, H, kv_lora, rope, page_size, dtype, DEVICE, seed=page_size)
    q, kv, *meta = args
    out = mla_extend(q, kv, *meta, kv_lora, 0.2)
    ref = mla_extend_ref(q.float(), kv.float(), *meta, kv_lora, 0.2)
    assert out.shape == (sum(EXTEND), H, kv_lora)
    assert_close_to_ref(out, ref, dtype)


def test_mla_extend_decode_case_equals_decode(poisoned_empty: None) -> None:
    """Extend with one new token per request is a decode step: same numbers as mla_decode's ref."""
    from r3trace.kernels.mla_decode import mla_decode_ref

    case = _extend_case([4, 30, 0], [1, 1, 1], 4, 24, 8, 2, torch.float32, DEVICE, seed=3)
    q, kv, r2t, rows, prefix, ext, loc = case
    out = mla_extend(q, kv, r2t, rows, prefix, ext, loc, 24, 0.3)
    ref = mla_decode_ref(q, kv, r2t, rows, prefix + ext, 24, 0.3)
    assert_close_to_ref(out, ref, torch.float32)


def _prefill_case(
    extend: list[int], H: int, dqk: int, dv: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    T = sum(extend)
    q, k = (torch.randn(T, H, dqk, generator=gen).to(device, dtype) for _ in range(2))
    v = torch.randn(T, H, dv, generator=gen).to(device, dtype)
    ext = torch.tensor(extend, dtype=torch.int64)
    return q, k, v, (torch.cumsum(ext, 0) - ext).to(device), ext.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("dqk", "dv"), [(20, 12), (24, 40)])  # neither a power of two; Dv > Dqk too
def test_mha_prefill_matches_ref(dtype: torch.dtype, dqk: int, dv: int, poisoned_empty: None) -> None:
    extend = [7, 1, 70, 0, 3]  # 70 crosses the 64-row tile
    q, k, v, loc, ext = _prefill_case(extend, 3, dqk, dv, dtype, DEVICE, seed=dqk)
    out = mha_prefill(q, k, v, loc, ext, dqk**-0.5)
    ref = mha_prefill_ref(q.float(), k.float(), v.float(), loc, ext, dqk**-0.5)
    assert out.shape == (sum(extend), 3, dv)
    assert_close_to_ref(out, ref, dtype)


def _prefix_case(prefix: list[int], extend: list[int], H: int, dqk: int, dv: int, dtype: torch.dtype,
                 seed: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Each request's keys [prefix + extend] laid end to end (k, v), its queries [extend] (q), and the tables."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    q = torch.randn(sum(extend), H, dqk, generator=gen).to(DEVICE, dtype)
    k = torch.randn(sum(lens), H, dqk, generator=gen).to(DEVICE, dtype)
    v = torch.randn(sum(lens), H, dv, generator=gen).to(DEVICE, dtype)
    ext, nk = torch.tensor(extend), torch.tensor(lens)
    return q, k, v, (ext.cumsum(0) - ext).to(DEVICE), ext.to(DEVICE), (nk.cumsum(0) - nk).to(DEVICE), nk.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mha_prefill_over_a_prefix_matches_ref(dtype: torch.dtype, poisoned_empty: None) -> None:
    """Queries on top of 0 / 5 / 33 / 70 earlier keys (70: past one 64-row query tile and two 32-key tiles); the ref
    itself checked against the prefix-free ref of each request's whole sequence (its last rows)."""
    prefix, extend = [0, 5, 33, 70, 4], [7, 1, 40, 3, 0]
    q, k, v, loc, ext, k_loc, k_lens = _prefix_case(prefix, extend, 3, 20, 12, dtype, seed=7)
    out = mha_prefill(q, k, v, loc, ext, 0.3, k_start_loc=k_loc, k_lens=k_lens)
    ref = mha_prefill_ref(q.float(), k.float(), v.float(), loc, ext, 0.3, k_start_loc=k_loc, k_lens=k_lens)
    assert_close_to_ref(out, ref, dtype)
    for b in range(4):  # the whole sequence with the queries' q in place of the last extend rows' own
        k0, n, e, s0 = int(k_loc[b]), int(k_lens[b]), extend[b], int(loc[b])
        q_all = torch.cat([k[k0 : k0 + n - e], q[s0 : s0 + e]]).float()  # [n, H, Dqk]: earlier rows' q is any
        whole = mha_prefill_ref(q_all, k[k0 : k0 + n].float(), v[k0 : k0 + n].float(),
                                torch.tensor([0], device=DEVICE), torch.tensor([n], device=DEVICE), 0.3)  # fmt: skip
        torch.testing.assert_close(ref[s0 : s0 + e], whole[n - e :], rtol=1e-6, atol=1e-6)


def test_mha_prefill_rows_do_not_depend_on_the_chunking() -> None:
    """One request of 100 keys in bf16: its rows computed at once and as chunks of 37, 1 and 62 on top of the earlier
    keys are bitwise the same (key tiles start at key 0 for every chunk; a tile past a row is -inf for it)."""
    q, k, v, *_ = _prefix_case([0], [100], 2, 24, 16, torch.bfloat16, seed=9)
    zero = torch.tensor([0], device=DEVICE)
    whole = mha_prefill(q, k, v, zero, torch.tensor([100], device=DEVICE), 0.2)
    pieces, done = [], 0
    for n in (37, 1, 62):
        lens = torch.tensor([n], device=DEVICE)
        pieces.append(mha_prefill(q[done : done + n], k, v, zero, lens, 0.2, k_start_loc=zero,
                                  k_lens=torch.tensor([done + n], device=DEVICE)))  # fmt: skip
        done += n
    assert torch.equal(torch.cat(pieces), whole)


def test_extend_rejects_bad_arguments() -> None:
    q, k, v, loc, ext = _prefill_case([3, 4], 2, 20, 12, torch.float32, DEVICE, seed=0)
    with pytest.raises(KernelInputError, match="k shape"):
        mha_prefill(q, k[:, :, :10], v, loc, ext, 0.2)
    with pytest.raises(KernelInputError, match="differ in length"):
        mha_prefill(q, k, v, loc[:1], ext, 0.2)
    with pytest.raises(KernelInputError, match="k_lens has 1 requests, extend_lens 2"):
        mha_prefill(q, k, v, loc, ext, 0.2, k_start_loc=loc, k_lens=ext[:1])
    qa, kv, *meta = _extend_case([1], [2], 2, 24, 8, 1, torch.float32, DEVICE, seed=0)
    with pytest.raises(KernelInputError, match="kv_lora_rank"):
        mla_extend(qa, kv, *meta, 32, 0.2)


@gpu
@requires_gpu
def test_mla_extend_deepseek_shape_gpu() -> None:
    args = _extend_case([0, 100, 700], [300, 37, 129], 16, 512, 64, 64, torch.bfloat16, "cuda", seed=1)
    q, kv, *meta = args
    out = mla_extend(q, kv, *meta, 512, 576**-0.5)
    ref = mla_extend_ref(q.float(), kv.float(), *meta, 512, 576**-0.5)
    assert_close_to_ref(out, ref, torch.bfloat16)


@gpu
@requires_gpu
def test_mha_prefill_deepseek_shape_gpu() -> None:
    q, k, v, loc, ext = _prefill_case([1000, 1, 257], 16, 192, 128, torch.bfloat16, "cuda", seed=2)
    out = mha_prefill(q, k, v, loc, ext, 192**-0.5)
    ref = mha_prefill_ref(q.float(), k.float(), v.float(), loc, ext, 192**-0.5)
    assert_close_to_ref(out, ref, torch.bfloat16)
