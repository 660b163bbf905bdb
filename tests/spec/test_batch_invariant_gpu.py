"""batch_invariant=True on CUDA in bf16 (the CPU interpreter's twin: tests/spec/test_batch_invariant.py): the GEMM's
and the fixed-split decode's rows bitwise the same in batches of 1, 3 and 17 rows, and at engine level a request's
tokens and routes bitwise the same alone and batched, speculative (CUDA graphs: verify and draft graphs) and plain.

Run (GPU): python -m pytest -q -m gpu tests/spec/test_batch_invariant_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from r3trace.kernels.invariant_matmul import invariant_linear
from r3trace.kernels.mla_decode.fixed_split import fixed_split_decoder
from tests.engine.conftest import EngineFactory
from tests.spec.test_batch_invariant import invariant, sampling
from tests.spec.test_spec_greedy import ASK, assert_mixed_acceptance, assert_same, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gemm_and_decode_rows_bitwise_on_cuda() -> None:
    """bf16 rows of an odd-shaped [37, 2100] x [2100, 777] product and of a 37-row decode (16 heads, kv_lora 512,
    rope 64, lengths 1..1500) computed in batches of 1, 3 and 17 rows equal the full batch's bits; cuBLAS's F.linear is
    printed beside it (it is not asserted: whether it differs depends on its heuristics)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 2100, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(777, 2100, device="cuda", dtype=torch.bfloat16, generator=gen)
    full = invariant_linear(x, w)
    for rows in (1, 3, 17):
        parts = torch.cat([invariant_linear(x[s : s + rows], w) for s in range(0, 37, rows)])
        assert torch.equal(parts, full), f"batches of {rows} rows"
    blas = torch.cat([torch.nn.functional.linear(x[s : s + 1], w) for s in range(37)])
    print("F.linear rows alone vs batched differ:", not torch.equal(blas, torch.nn.functional.linear(x, w)))
    h, c, kvl = 16, 576, 512
    kv = torch.randn(4096, c, device="cuda", dtype=torch.bfloat16, generator=gen)
    r2t = torch.randperm(4096, device="cuda", generator=gen).to(torch.int32).view(2, 2048)
    q = torch.randn(37, h, c, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.randint(1, 1500, (37,), device="cuda", generator=gen)
    pool = torch.arange(37, device="cuda") % 2
    dec = fixed_split_decoder(h, torch.bfloat16)
    full = dec(q, kv, r2t, pool, lens, kvl, 0.07, 1500)
    for rows in (1, 3, 17):
        parts = torch.cat([dec(q[s : s + rows], kv, r2t, pool[s : s + rows], lens[s : s + rows], kvl, 0.07, 2048)
                           for s in range(0, 37, rows)])  # fmt: skip
        assert torch.equal(parts, full), f"decode rows in batches of {rows}"


def test_engine_alone_batched_and_speculative_on_cuda(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """bf16 with CUDA graphs (the default ladder): each request alone, all six batched in 16-token chunks, and the
    speculative engine (d = 3, verify and draft graphs): bitwise the same tokens, logprobs and routes."""
    opts = invariant("bfloat16", device="cuda", chunked_prefill_size=16)
    plain = make_spec_engine(model=mtp_ckpt, **opts)
    spec = make_spec_engine(model=mtp_ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3, **opts)
    ps, sp = prompts(seed=11), sampling(6)
    batched = plain.generate(input_ids=ps, sampling_params=sp, **ASK)
    alone = [plain.generate(input_ids=p, sampling_params=s, **ASK) for p, s in zip(ps, sp, strict=True)]
    got = spec.generate(input_ids=ps, sampling_params=sp, **ASK)
    assert_same(alone, batched)
    assert_same(got, batched)
    assert_mixed_acceptance(got)
