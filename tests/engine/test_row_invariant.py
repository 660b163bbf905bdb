"""row_invariant (EngineConfig's default on CUDA with the triton backends): decode and verify rows on the absorbed path
through the fixed-split attention, prompt rows on the normal path (MHA over every key read back from the cache), the
invariant GEMM, MoE plan and router logits everywhere. Here on the CPU: the option's resolution and refusals, the
scheduler's decodes-first order and the batch's leading rows. At engine level (Triton's interpreter, fp32: a request
alone equals it batched in 16-token chunks, speculation equals plain decoding): tests/spec/test_batch_invariant.py;
the same in bf16 on the H200: tests/spec/test_batch_invariant_gpu.py.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_row_invariant.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3trace.engine.engine_config import EngineConfig, EngineConfigError
from r3trace.engine.forward_batch import ForwardBatch
from tests.engine.conftest import EngineFactory
from tests.spec.test_batch_invariant import TRITON, sampling

CUDA = dict(device="cuda", dtype="bfloat16", **TRITON)


def test_auto_is_on_for_the_triton_backends_on_cuda_only() -> None:
    cfg = EngineConfig(**CUDA)  # type: ignore[arg-type]
    assert cfg.row_invariant_on
    assert (cfg.attention_impl, cfg.moe_impl, cfg.topk_impl, cfg.matmul_impl, cfg.mla_impl) == (
        "row_invariant", "invariant", "invariant", "invariant", "split")
    draft = cfg.draft_config  # the MTP draft: the fast kernels
    assert not draft.row_invariant_on and (draft.attention_impl, draft.mla_impl) == ("triton", "auto")
    assert not EngineConfig().row_invariant_on  # CPU, ref backends
    assert not EngineConfig(**TRITON).row_invariant_on  # type: ignore[arg-type]  # the CPU interpreter
    assert not EngineConfig(**{**CUDA, "moe_backend": "ref"}).row_invariant_on  # type: ignore[arg-type]
    assert not EngineConfig(**CUDA, row_invariant=False).row_invariant_on  # type: ignore[arg-type]
    assert not EngineConfig(**CUDA, mla_path="absorb").row_invariant_on  # type: ignore[arg-type]
    every = EngineConfig(**CUDA, batch_invariant=True)  # type: ignore[arg-type]
    assert not every.row_invariant_on and (every.attention_impl, every.mla_impl) == ("invariant", "absorb")
    forced = EngineConfig(**TRITON, row_invariant=True)  # type: ignore[arg-type]  # the interpreter, asked for
    assert forced.row_invariant_on and forced.mla_impl == "split"


def test_refusals_name_the_option() -> None:
    with pytest.raises(EngineConfigError, match="moe_backend='ref': row_invariant=True needs the triton backend"):
        EngineConfig(row_invariant=True, **{**TRITON, "moe_backend": "ref"})  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="mla_path='normal': row_invariant=True picks the path by row"):
        EngineConfig(row_invariant=True, mla_path="normal", **TRITON)  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="row_invariant=True with deterministic or batch_invariant"):
        EngineConfig(row_invariant=True, batch_invariant=True, **TRITON)  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="row_invariant='yes': expected None"):
        EngineConfig(row_invariant="yes")  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="row_invariant=True with tp_size=2.*one process only"):
        EngineConfig(row_invariant=True, **TRITON).check_graph_layout(2, 1, 1)  # type: ignore[arg-type]
    EngineConfig(**CUDA).check_graph_layout(2, 1, 1)  # type: ignore[arg-type]  # auto: the kernels, no claim


def _batch(prefix: list[int], extend: list[int], phases: list) -> ForwardBatch:
    t = sum(extend)
    return ForwardBatch.build(
        forward_id=0, input_ids=list(range(2, 2 + t)), prefix_lens=prefix, extend_lens=extend,
        req_pool_indices=[7, 3, 5, 1][: len(extend)], out_cache_loc=np.arange(100, 100 + t),
        req_to_token=torch.zeros(8, 64, dtype=torch.int32), logits_rows=[t - 1], device="cpu", phases=phases,
    )  # fmt: skip


def test_leading_decode_rows_and_the_prompt_sub_batch() -> None:
    fb = _batch([5, 9, 0, 30], [4, 1, 6, 3], ["verify", "decode", "prefill", "decode"])
    assert (fb.lead_requests, fb.lead_rows) == (2, 5)  # the decode after the prompt is not leading
    tail = fb.requests(2, 4)
    assert tail.input_ids.tolist() == list(range(7, 16)) and tail.positions.tolist() == [0, 1, 2, 3, 4, 5, 30, 31, 32]
    assert tail.extend_start_loc.tolist() == [0, 6] and tail.req_pool_indices.tolist() == [5, 1]
    assert (tail.seq_lens_cpu, tail.prefix_lens_cpu, tail.phases, tail.mode) == ([6, 33], [0, 30],
                                                                               ["prefill", "decode"], "extend")
    assert tail.out_cache_loc.tolist() == list(range(105, 114)) and tail.has_prefix
    head = fb.requests(1, 2)
    assert (head.mode, head.positions.tolist(), head.extend_start_loc.tolist()) == ("decode", [9], [0])
    assert fb.requests(0, 4) is fb
    plain = _batch([5, 9], [1, 1], [])  # no phases: a decode batch leads whole, an extend not at all
    assert (plain.lead_requests, plain.lead_rows) == (2, 2)
    assert _batch([0, 9], [3, 1], []).lead_requests == 0


def test_the_scheduler_puts_decodes_and_verifies_first(make_engine: EngineFactory) -> None:
    """A 40-token prompt in 16-token chunks beside three short ones: every step's decode rows lead its batch."""
    engine = make_engine(chunked_prefill_size=16)
    seen: list[list[str]] = []
    run = engine.runner.launch

    def spy(items, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append([it.phase for it in items])
        return run(items, *args, **kwargs)

    engine.runner.launch = spy  # type: ignore[method-assign]
    engine.generate(input_ids=[[3] * 40, [4] * 3, [5] * 9, [6] * 5], sampling_params=sampling(4))
    mixed = [p for p in seen if "prefill" in p and "decode" in p]
    assert mixed, "no step mixed prompt chunks with decodes: the test checks nothing"
    for phases in seen:
        assert phases == sorted(phases, key=lambda ph: ph == "prefill"), phases
