"""decode_invariant (EngineConfig's default on CUDA with the triton backends): batch_invariant's kernels for every step
of at most decode_rows rows, the fast ones above. Here on the CPU: the option's resolution and refusals, and that each
op picks the invariant or the fast kernel by the step's shape, checked on values (the two kernels' bits differ on these
inputs). The bits on the H200 (speculation equals plain decoding, token for token and route for route, in bf16):
tests/spec/test_batch_invariant_gpu.py.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/engine/test_decode_invariant.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from r3trace.engine.engine_config import EngineConfig, EngineConfigError
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.layers.attention_backend import SHORT_EXTEND_ROWS, DecodeInvariantAttention
from r3trace.engine.layers.matmul import RowBound, make_head_matmul, make_matmul
from r3trace.engine.layers.router import make_routing_ops
from r3trace.kernels.invariant_matmul import invariant_bmm, invariant_linear

TRITON = dict.fromkeys(("attention_backend", "moe_backend", "topk_backend", "norm_backend", "rope_backend"), "triton")
CUDA = dict(device="cuda", dtype="bfloat16", **TRITON)


def test_auto_is_on_for_the_triton_backends_on_cuda_only() -> None:
    cfg = EngineConfig(**CUDA, max_running_requests=48, chunked_prefill_size=8192)  # type: ignore[arg-type]
    assert cfg.decode_invariant_on
    # the five implementations: the MoE's invariant plan at every T, the rest bounded by decode_rows
    assert (cfg.attention_impl, cfg.moe_impl, cfg.topk_impl, cfg.matmul_impl, cfg.mla_impl) == (
        "decode_invariant", "invariant", "decode_invariant", RowBound(192), "auto")
    assert not EngineConfig().decode_invariant_on  # CPU, ref backends
    assert not EngineConfig(**TRITON).decode_invariant_on  # type: ignore[arg-type]  # the CPU interpreter
    assert not EngineConfig(**{**CUDA, "moe_backend": "ref"}).decode_invariant_on  # type: ignore[arg-type]
    assert not EngineConfig(**CUDA, decode_invariant=False).decode_invariant_on  # type: ignore[arg-type]
    assert not EngineConfig(**CUDA, mla_path="normal").decode_invariant_on  # type: ignore[arg-type]
    every = EngineConfig(**CUDA, batch_invariant=True)  # type: ignore[arg-type]
    assert not every.decode_invariant_on and every.matmul_impl == "invariant"
    forced = EngineConfig(**TRITON, decode_invariant=True)  # type: ignore[arg-type]  # the interpreter, asked for
    assert forced.decode_invariant_on and forced.attention_impl == "decode_invariant"


def test_decode_rows_covers_every_decode_and_verify_step_alike_with_speculation_on_or_off() -> None:
    """A step's tokens are at most chunked_prefill_size; a decode step holds max_running_requests rows, a verify up to
    1 + 3 a request. The bound is the same with and without speculation, so a plain engine and a speculative one with
    the same limits run a prompt step of T rows on the same kernels."""
    for chunk, running, want in ((8192, 64, 256), (200, 64, 200), (32, 64, 64)):
        plain = EngineConfig(**CUDA, chunked_prefill_size=chunk, max_running_requests=running)  # type: ignore[arg-type]
        spec = EngineConfig(**CUDA, chunked_prefill_size=chunk, max_running_requests=running,  # type: ignore[arg-type]
                            speculative_algorithm="NEXTN", speculative_num_steps=1)  # fmt: skip
        assert plain.decode_rows == spec.decode_rows == want
        assert spec.max_graph_batch * 2 <= want and plain.max_graph_batch <= want


def test_refusals_name_the_option() -> None:
    with pytest.raises(EngineConfigError, match="moe_backend='ref': decode_invariant=True needs the triton backend"):
        EngineConfig(decode_invariant=True, **{**TRITON, "moe_backend": "ref"})  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="mla_path='normal'"):
        EngineConfig(decode_invariant=True, mla_path="normal", **TRITON)  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="decode_invariant=True with deterministic or batch_invariant"):
        EngineConfig(decode_invariant=True, batch_invariant=True, **TRITON)  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="decode_invariant='yes': expected None"):
        EngineConfig(decode_invariant="yes")  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="decode_invariant=True with tp_size=2.*one process only"):
        EngineConfig(decode_invariant=True, **TRITON).check_graph_layout(2, 1, 1)  # type: ignore[arg-type]
    EngineConfig(**CUDA).check_graph_layout(2, 1, 1)  # type: ignore[arg-type]  # auto: the kernels, no claim


def _differ(a: torch.Tensor, b: torch.Tensor) -> None:
    assert not torch.equal(a, b), "the two kernels agree bitwise on this input: the test cannot tell them apart"


def test_row_bound_linear_runs_the_invariant_kernel_up_to_the_bound_and_torch_above() -> None:
    """fp32, K = 300: Triton's interpreter sums K in 32-wide steps, torch's CPU GEMM in its own blocks."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 300, generator=gen)
    w = torch.randn(45, 300, generator=gen)
    bounded = make_matmul(RowBound(5), 300)
    _differ(invariant_linear(x[:5], w), F.linear(x[:5], w))
    assert torch.equal(bounded(x[:5], w), invariant_linear(x[:5], w))
    assert torch.equal(bounded(x[:5], w)[2], invariant_linear(x[2:3], w)[0])  # a row's bits alone or among 5
    assert torch.equal(bounded(x, w), F.linear(x, w))


def test_row_bound_head_product_splits_by_rows_too() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, 200, generator=gen)  # [T, H, In]
    w = torch.randn(3, 200, 40, generator=gen)  # [H, In, Out]
    head = make_head_matmul(RowBound(4))
    for t in (4, 6):
        out = torch.empty(t, 3, 40)
        head(x[:t], w, out)
        inv = invariant_bmm(x[:t].transpose(0, 1), w).transpose(0, 1)
        blas = torch.bmm(x[:t].transpose(0, 1), w).transpose(0, 1)
        _differ(inv, blas)
        assert torch.equal(out, inv if t <= 4 else blas), f"T = {t}"


def test_router_logits_take_the_kernel_up_to_the_bound() -> None:
    """The kernel returns 8 partial sums over slices of D ([8, T, E]), torch one ([1, T, E])."""
    ops = make_routing_ops("decode_invariant", 300)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(16, 512, generator=gen)  # D = 512: 8 slices of 64
    x = torch.randn(301, 512, generator=gen)
    assert ops.logits(x[:300], w).shape[0] > 1
    assert ops.logits(x, w).shape[0] == 1
    low = make_routing_ops("decode_invariant", 8)  # the default's kernel up to 256 rows already: never below that
    assert low.logits(x[:256], w).shape[0] > 1


class _Tagged:
    """An attention backend whose output is its tag: which one the batch went to."""

    def __init__(self, tag: float) -> None:
        self.tag = tag

    def absorbed(self, q: torch.Tensor, kv_cache: torch.Tensor, fb: ForwardBatch, kv_lora_rank: int,
                 scale: float) -> torch.Tensor:  # fmt: skip
        return torch.full((q.shape[0], q.shape[1], kv_lora_rank), self.tag)

    def mha(self, q: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.full(q.shape, self.tag)


def _batch(prefix: list[int], extend: list[int]) -> ForwardBatch:
    t = sum(extend)
    return ForwardBatch.build(
        forward_id=0, input_ids=[2] * t, prefix_lens=prefix, extend_lens=extend,
        req_pool_indices=list(range(len(extend))), out_cache_loc=np.arange(t),
        req_to_token=torch.zeros(len(extend), 64, dtype=torch.int32), logits_rows=[t - 1], device="cpu",
    )  # fmt: skip


@pytest.mark.parametrize(("prefix", "extend", "invariant"), [
    ([5, 9, 30], [1, 1, 1], True),  # a decode step
    ([5, 9], [4, 4], True),  # verifies of 1 + 3
    ([5, 9], [SHORT_EXTEND_ROWS, 2], True),  # short extends
    ([5, 9], [SHORT_EXTEND_ROWS + 1, 1], False),  # a prompt chunk on a prefix beside a decode row
    ([0, 0], [20, 7], False),  # a prefix-free prefill (the MHA form when the MLA picks it)
])  # fmt: skip
def test_attention_picks_the_invariant_kernel_for_decode_and_short_extends(
    prefix: list[int], extend: list[int], invariant: bool
) -> None:
    backend = DecodeInvariantAttention(_Tagged(0.0), _Tagged(1.0))  # type: ignore[arg-type]
    fb = _batch(prefix, extend)
    q = torch.zeros(fb.num_tokens, 2, 8)
    out = backend.absorbed(q, torch.zeros(64, 8), fb, 4, 1.0)
    assert torch.equal(out, torch.full_like(out, float(invariant)))
    assert backend.mha(q, q, q, fb, [0], [1], 1.0).eq(0.0).all()  # the MHA prefill is the fast kernel's only
