"""batch_invariant=True on CUDA in bf16 (the CPU interpreter's twin: tests/spec/test_batch_invariant.py): the GEMM's
and the fixed-split attention's rows bitwise the same in batches of 1, 3 and 17 rows, a prefill chunk's rows the same
as decode rows, and at engine level a request's
tokens and routes bitwise the same alone and batched, speculative (CUDA graphs: verify and draft graphs) and plain.
And the default engine (row_invariant on by itself; tests/engine/test_row_invariant.py and test_batch_invariant.py on
the CPU): alone equals batched and speculation equals plain decoding, bitwise.

Run (GPU): python -m pytest -q -m gpu tests/spec/test_batch_invariant_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from r3trace.kernels.invariant_matmul import invariant_linear
from r3trace.kernels.mla_decode.fixed_split import fixed_split_decoder
from r3trace.kernels.mla_decode.reference import mla_decode_ref
from tests.engine.conftest import EngineFactory
from tests.spec.test_batch_invariant import TRITON, invariant, sampling
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
    keys = torch.randint(1, 1500, (37,), device="cuda", generator=gen)
    pool = torch.arange(37, device="cuda") % 2
    dec = fixed_split_decoder(h, torch.bfloat16)
    one = torch.ones(37, dtype=torch.int64, device="cuda")
    full = dec(q, kv, r2t, pool, torch.arange(37, device="cuda"), one, keys, kvl, 0.07, 1500, 1)
    for rows in (1, 3, 17):
        parts = torch.cat([dec(q[s : s + rows], kv, r2t, pool[s : s + rows], torch.arange(len(pool[s : s + rows]),
                           device="cuda"), one[s : s + rows], keys[s : s + rows], kvl, 0.07, 2048, 1)
                           for s in range(0, 37, rows)])  # fmt: skip
        assert torch.equal(parts, full), f"decode rows in batches of {rows}"


@pytest.mark.parametrize("heads", [16, 128])
def test_prefill_chunk_rows_equal_decode_rows_on_cuda(heads: int) -> None:
    """bf16, kv_lora 512 + rope 64: 300 consecutive rows of one request over 1,500..1,799 keys (7 fixed splits each)
    computed as one prefill chunk, as verifies of 4 rows, in chunks of 7, one chunk offset by 1 and as 300 decode
    rows are bitwise the same: a row's bits do not depend on the other rows of its token block (16 heads: 4 tokens
    a program; 128 heads: one). And close to the fp32 reference (bf16 output rounding, 2^-8 relative)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    c, kvl, n = 576, 512, 300
    kv = torch.randn(4096, c, device="cuda", dtype=torch.bfloat16, generator=gen)
    r2t = torch.randperm(4096, device="cuda", generator=gen).to(torch.int32).view(2, 2048)
    q = torch.randn(n, heads, c, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
    keys = torch.arange(1500, 1500 + n, device="cuda")
    dec = fixed_split_decoder(heads, torch.bfloat16)

    def chunks(sizes: list[int]) -> torch.Tensor:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        t = lambda v: torch.tensor(v, device="cuda")  # noqa: E731
        return dec(q, kv, r2t, t([1] * len(sizes)), t(starts), t(sizes), keys, kvl, 0.07, 2048, max(sizes))

    full = chunks([n])
    for sizes in ([4] * (n // 4), [7] * (n // 7) + [n % 7], [1, n - 1], [1] * n):
        assert torch.equal(chunks(sizes), full), f"chunks {sizes[:3]}..."
    ref = mla_decode_ref(q, kv, r2t, torch.ones(n, dtype=torch.int64, device="cuda"), keys, kvl, 0.07)
    torch.testing.assert_close(full.float(), ref.float(), rtol=2**-7, atol=2**-7)


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
    # chained launches (3 greedy steps a graph; logprobs unasked, else a launch runs one step): the same again
    chained = make_spec_engine(model=mtp_ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3,
                               speculative_launch_steps=3, **opts)
    graphs = chained.runner.spec_graphs
    assert graphs is not None and graphs.launch_steps == 3
    before = (graphs.graph_steps, graphs.replays)
    got = chained.generate(input_ids=ps, sampling_params=sp, return_routed_experts=True)
    for g, w in zip(got, batched, strict=True):
        assert (g["output_ids"], g["meta_info"]["routed_experts"]) == (w["output_ids"],
                                                                       w["meta_info"]["routed_experts"])
    # a greedy graph step is one replay, a chained launch one replay of 3 steps
    assert graphs.graph_steps - before[0] > graphs.replays - before[1], "no launch ran chained"


def test_default_engine_alone_batched_and_speculative_on_cuda(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """The default engine in bf16 with CUDA graphs, no invariance option given (row_invariant resolves on): each
    request alone, all six batched in 16-token chunks (prompt chunks on a cached prefix beside decode rows), and the
    speculative engine (d = 3, chained launches and one step a launch): bitwise the same tokens, logprobs and
    routes."""
    opts = dict(dtype="bfloat16", device="cuda", chunked_prefill_size=16, **TRITON)
    plain = make_spec_engine(model=mtp_ckpt, **opts)
    assert plain.config.row_invariant_on and plain.config.graph_batch_sizes
    ps, sp = prompts(seed=11), sampling(6)
    batched = plain.generate(input_ids=ps, sampling_params=sp, **ASK)
    alone = [plain.generate(input_ids=p, sampling_params=s, **ASK) for p, s in zip(ps, sp, strict=True)]
    assert_same(alone, batched)
    for launch in (4, 1):
        spec = make_spec_engine(model=mtp_ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3,
                                speculative_launch_steps=launch, **opts)  # fmt: skip
        got = spec.generate(input_ids=ps, sampling_params=sp, **ASK)
        assert_same(got, batched)
        assert_mixed_acceptance(got)
