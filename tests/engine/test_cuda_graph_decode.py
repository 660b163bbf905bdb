"""CUDA-graph decode gives eager decode's tokens and routes (GPU only).

Run: .venv/bin/pytest -q -m gpu tests/engine/test_cuda_graph_decode.py
Batch sizes between captured sizes run padded (3 requests on the 4-request graph), and the route capturer
writes inside the graph: the routes returned must equal eager mode's row for row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import r3trace
from tests.engine.conftest import EngineFactory, greedy, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TRITON = dict(attention_backend="triton", moe_backend="triton", topk_backend="triton", norm_backend="triton",
              rope_backend="triton", device="cuda")


@pytest.mark.parametrize("n_requests", [1, 3, 8])
def test_graph_decode_matches_eager(make_engine: EngineFactory, n_requests: int) -> None:
    prompts = random_prompts(n_requests, 5, 30, seed=40 + n_requests)
    graphs = make_engine(cuda_graph_batch_sizes=(1, 2, 4, 8), max_running_requests=8, **TRITON)
    eager = make_engine(cuda_graph_batch_sizes=(), max_running_requests=8, **TRITON)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    a = graphs.generate(input_ids=prompts, sampling_params=greedy(10), return_routed_experts=True)
    b = eager.generate(input_ids=prompts, sampling_params=greedy(10), return_routed_experts=True)
    for x, y in zip(a, b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        np.testing.assert_array_equal(r3trace.decode_routed_experts(x["meta_info"]),
                                      r3trace.decode_routed_experts(y["meta_info"]))


def test_graphs_need_triton_on_cuda(make_engine: EngineFactory) -> None:
    from r3trace.engine.engine_config import EngineConfigError

    with pytest.raises(EngineConfigError, match="cuda_graph_batch_sizes"):
        make_engine(cuda_graph_batch_sizes=(1, 2), device="cuda")  # ref backends
