"""Speculative decoding on a GPU with the triton backends, eager (cuda_graph_batch_sizes=(); graphs:
tests/spec/test_spec_graphs_gpu.py): the device paths the CPU tests cannot take (pinned staging, the capture copy on
its side stream, triton extend attention for verify rows, fused MoE and top-k in the draft layer).

Run (GPU): python -m pytest -q -m gpu tests/spec/test_spec_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import r3trace
from tests.engine.conftest import EngineFactory
from tests.spec.conftest import VOCAB

TRITON = dict(attention_backend="triton", moe_backend="triton", topk_backend="triton", norm_backend="triton",
              rope_backend="triton", device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_speculation_on_the_gpu_matches_plain_decoding(make_spec_engine: EngineFactory, mtp_ckpt: Path) -> None:
    """fp32, greedy: the same tokens as the plain engine (eager, no overlap, so both see the same batches) and routes
    equal on every row; both accepted and rejected drafts; the pool whole afterwards. fp32 verify rows are an
    extend's arithmetic, decode rows a decode kernel's: a token could differ only at a near tie of the tiny model's
    logits, which this fixed set of prompts does not have (the assertion would say which request)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, VOCAB, size=int(n)).tolist() for n in rng.integers(4, 40, size=12)]
    sp = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    spec = make_spec_engine(model=mtp_ckpt, speculative_algorithm="NEXTN", chunked_prefill_size=64,
                            cuda_graph_batch_sizes=(), **TRITON)
    plain = make_spec_engine(model=mtp_ckpt, chunked_prefill_size=64, overlap_schedule=False,
                             cuda_graph_batch_sizes=(), **TRITON)
    got = spec.generate(input_ids=prompts, sampling_params=sp, return_routed_experts=True)
    want = plain.generate(input_ids=prompts, sampling_params=sp, return_routed_experts=True)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a["output_ids"] == b["output_ids"], f"request {i}"
        np.testing.assert_array_equal(r3trace.decode_routed_experts(a["meta_info"]),
                                      r3trace.decode_routed_experts(b["meta_info"]))
    correct = sum(o["meta_info"]["spec_num_correct_drafts"] for o in got)
    assert 0 < correct < sum(o["meta_info"]["spec_num_proposed_drafts"] for o in got)
    sampled = spec.generate(input_ids=prompts, sampling_params={**sp, "temperature": 1.0, "top_p": 0.9})
    assert all(len(o["output_ids"]) == 16 for o in sampled)
    assert spec.flush_cache() and spec.kv_pool.num_free_pages == spec.kv_pool.num_pages
