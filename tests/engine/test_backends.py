"""End to end: the triton backends (attention, MoE, top-k, RMSNorm, RoPE) give the ref backends' greedy
tokens and routes.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/engine/test_backends.py
On CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by `make test`); on a GPU
they compile. Chunked prefill (extend over a cached prefix), prefix-free prefill and decode all run,
so mha_prefill, mla_extend and mla_decode are each exercised.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import r3trace
from tests.engine.conftest import EngineFactory, greedy, random_prompts

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton on CPU needs TRITON_INTERPRET=1", allow_module_level=True)


@pytest.mark.parametrize(
    "backends",
    [
        dict(attention_backend="triton", moe_backend="triton", topk_backend="triton", norm_backend="triton",
             rope_backend="triton"),
        dict(attention_backend="triton"),
        dict(moe_backend="triton", topk_backend="triton"),
        dict(norm_backend="triton", rope_backend="triton"),
    ],
    ids=["all", "attention", "moe+topk", "norm+rope"],
)
@pytest.mark.parametrize("page_size", [1, 3])
def test_triton_backends_match_ref(make_engine: EngineFactory, backends: dict[str, str], page_size: int) -> None:
    prompts = random_prompts(3, 5, 17, seed=30)
    common = dict(chunked_prefill_size=8, page_size=page_size, kv_pool_tokens=240, device=DEVICE)
    ref = make_engine(**common).generate(input_ids=prompts, sampling_params=greedy(5), return_routed_experts=True)
    tri = make_engine(**common, **backends).generate(input_ids=prompts, sampling_params=greedy(5),
                                                     return_routed_experts=True)
    for a, b in zip(ref, tri, strict=True):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_array_equal(r3trace.decode_routed_experts(a["meta_info"]),
                                      r3trace.decode_routed_experts(b["meta_info"]))
