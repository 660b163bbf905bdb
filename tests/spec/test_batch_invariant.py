"""batch_invariant=True (the triton path with fixed reduction orders): a request's tokens, logprobs and routes are
bitwise the same alone and in a batch, and speculative decoding equals plain decoding, on the CPU interpreter in fp32
and bf16 (tests/spec/test_batch_invariant_gpu.py: the same on CUDA bf16).

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_batch_invariant.py

Without batch_invariant these are not equal in bf16: the decode kernel's split count follows the batch, a verify runs
the extend kernel, the MoE switches gemv <-> grouped by T (BENCHMARKS.md#speculative-decoding: 79 route mismatches
between two plain runs batching the same requests differently on the H200).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from r3trace.engine.engine_config import EngineConfig, EngineConfigError
from tests.engine.conftest import EngineFactory
from tests.spec.test_spec_greedy import ASK, assert_mixed_acceptance, assert_same, prompts

TRITON = dict(attention_backend="triton", moe_backend="triton", topk_backend="triton", norm_backend="triton",
              rope_backend="triton")  # fmt: skip


def invariant(dtype: str, **options: Any) -> dict[str, Any]:
    return dict(batch_invariant=True, dtype=dtype, **TRITON, **options)


def sampling(n: int) -> list[dict[str, Any]]:
    return [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in (5, 9, 12, 3, 8, 10)[:n]]


# bf16 on the interpreter takes about a minute a test, fp32 30-60 s: the CPU suite (15 minutes on two cores) keeps
# the default mode's test below: alone-vs-batched and speculation-vs-plain through batch_invariant's GEMMs, MoE plan,
# router logits and fixed-split decode (its prompt rows take MHA instead); batch_invariant's own runs are in the slow
# set here and run in bf16 on CUDA (test_batch_invariant_gpu.py)
SLOW_DTYPES = [pytest.param(d, marks=pytest.mark.slow) for d in ("float32", "bfloat16")]


@pytest.mark.parametrize("dtype", SLOW_DTYPES)
def test_alone_equals_batched(make_spec_engine: EngineFactory, mtp_ckpt: Path, dtype: str) -> None:
    """Each request alone (batch 1, one prefill) against four at once in 16-token chunks (the 40-token prompt's chunks
    mixed with other requests' decode rows, decode batches of 1..4): bitwise the same tokens, logprobs and routes."""
    engine = make_spec_engine(model=mtp_ckpt, chunked_prefill_size=16, **invariant(dtype))
    ps, sp = prompts(seed=11)[:4], sampling(4)
    batched = engine.generate(input_ids=ps, sampling_params=sp, **ASK)
    alone = [engine.generate(input_ids=p, sampling_params=s, **ASK) for p, s in zip(ps, sp, strict=True)]
    assert_same(alone, batched)


@pytest.mark.parametrize("dtype", SLOW_DTYPES)
def test_speculation_equals_plain(make_spec_engine: EngineFactory, mtp_ckpt: Path, dtype: str) -> None:
    """d = 3 chain drafts verified 4 rows a request (verifies mixed with the 40-token prompt's chunks) against plain
    decoding: bitwise equal tokens, logprobs and routes, with drafts both accepted and rejected."""
    spec = make_spec_engine(model=mtp_ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3,
                            chunked_prefill_size=16, **invariant(dtype))  # fmt: skip
    plain = make_spec_engine(model=mtp_ckpt, chunked_prefill_size=16, **invariant(dtype))
    ps, sp = prompts(seed=5)[:4], sampling(4)
    got = spec.generate(input_ids=ps, sampling_params=sp, **ASK)
    want = plain.generate(input_ids=ps, sampling_params=sp, **ASK)
    assert_same(got, want)
    assert_mixed_acceptance(got)


ROW = dict(row_invariant=True, dtype="float32", chunked_prefill_size=16, **TRITON)


def test_alone_equals_batched_and_speculation_equals_plain(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """row_invariant=True, fp32, Triton's interpreter: two requests alone (one prefill each) against both at once in
    16-token chunks (the 40-token prompt's chunks on a cached prefix beside the other's decode rows), and d = 3
    speculation against plain decoding: bitwise the same tokens, logprobs and routes, drafts both accepted and
    rejected. Off, alone and batched differ in their logprobs here."""
    plain = make_spec_engine(model=mtp_ckpt, **ROW)
    assert plain.config.mla_impl == "split"
    ps, sp = prompts(seed=5)[:2], sampling(2)  # 40 and 3 tokens: the long one's chunks beside the short one's decodes
    batched = plain.generate(input_ids=ps, sampling_params=sp, **ASK)
    alone = [plain.generate(input_ids=p, sampling_params=s, **ASK) for p, s in zip(ps, sp, strict=True)]
    assert_same(alone, batched)
    spec = make_spec_engine(model=mtp_ckpt, speculative_algorithm="NEXTN", speculative_num_steps=3, **ROW)
    got = spec.generate(input_ids=ps, sampling_params=sp, **ASK)
    assert_same(got, batched)
    assert_mixed_acceptance(got)


def test_config_refusals() -> None:
    """One-line refusals: with exact mode, on a ref backend, on the normal MLA path, over several ranks."""
    with pytest.raises(EngineConfigError, match="pick one"):
        EngineConfig(batch_invariant=True, deterministic=True)
    with pytest.raises(EngineConfigError, match="moe_backend='ref': batch_invariant=True needs the triton"):
        EngineConfig(batch_invariant=True, **{**TRITON, "moe_backend": "ref"})
    with pytest.raises(EngineConfigError, match="mla_path='normal'"):
        EngineConfig(batch_invariant=True, mla_path="normal", **TRITON)
    cfg = EngineConfig(batch_invariant=True, **TRITON)
    with pytest.raises(EngineConfigError, match="tp_size=2, dp_size=1, ep_size=1: one process only"):
        cfg.check_graph_layout(2, 1, 1)
    assert (cfg.mla_impl, cfg.attention_impl, cfg.moe_impl, cfg.topk_impl, cfg.matmul_impl) == (
        "absorb", "invariant", "invariant", "invariant", "invariant")
