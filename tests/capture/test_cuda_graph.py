"""Route capture inside a CUDA graph: the routing op's slice write into the static device buffer
replays exactly like eager execution. GPU only.

Run: .venv/bin/pytest -q -m gpu tests/capture/test_cuda_graph.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.tiny_models import load_engine_model
from r3trace.capture.capturer import CaptureConfig, RoutedExpertsCapturer
from r3trace.engine.forward_batch import ForwardBatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_graph_replay_routes_equal_eager(tiny_ckpt: Path) -> None:
    model = load_engine_model(tiny_ckpt, device="cuda")
    cfg = model.config
    capturer = RoutedExpertsCapturer(CaptureConfig(
        num_hidden_layers=cfg.num_hidden_layers, moe_layer_ids=cfg.moe_layer_ids, top_k=cfg.num_experts_per_tok,
        num_experts=cfg.n_routed_experts, kv_slots=64, max_batch_tokens=64, chunked_prefill_size=64,
        max_running_requests=64, device="cuda",
    ))
    routers = [layer.mlp.gate for layer in model.model.layers if layer.is_moe]
    for r in routers:
        r.recorder = capturer  # test only: inject the capturer after construction
    t = 24
    fb = ForwardBatch.build(forward_id=0, input_ids=[0] * t, prefix_lens=[0], extend_lens=[t], req_pool_indices=[0],
                            out_cache_loc=torch.arange(t), req_to_token=torch.zeros(1, t, dtype=torch.int32),
                            logits_rows=[0], device="cuda")
    static_x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as torch requires
        for r in routers:
            r(static_x, fb)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in routers:
            r(static_x, fb)
    for seed in range(3):
        gen = torch.Generator("cuda").manual_seed(seed)
        static_x.copy_(torch.randn(t, cfg.hidden_size, device="cuda", generator=gen))
        capturer.buffers.dev_ids.fill_(-1)
        graph.replay()
        replayed = capturer.buffers.dev_ids[:, :t].clone()  # [M, T, K]
        capturer.buffers.dev_ids.fill_(-1)
        for r in routers:
            r(static_x, fb)
        eager = capturer.buffers.dev_ids[:, :t].clone()
        assert (eager >= 0).all()
        assert torch.equal(replayed, eager)


@pytest.mark.parametrize("wanted", ["all", "every-other"])
def test_engine_on_cuda_returns_the_direct_forwards_routes(tiny_ckpt: Path, wanted: str) -> None:
    """The CUDA copy path end to end (pinned staging, the copy stream, the reused device buffer and events, slots
    from the host): every returned route row equals a direct forward's, with all requests asking (all rows copied)
    and with every other one asking (a subset of rows gathered on the device), under CUDA graphs and overlap."""
    from r3trace.engine import Engine
    from tests.capture.helpers import assert_routes_exact
    from tests.engine.conftest import greedy, random_prompts

    prompts = random_prompts(7, 4, 30, seed=5)
    opts = dict(attention_backend="triton", moe_backend="triton", topk_backend="triton", norm_backend="triton",
                rope_backend="triton", device="cuda", cuda_graph_batch_sizes=(1, 2, 4, 8), max_running_requests=8)
    with Engine(tiny_ckpt, **opts) as eng:  # type: ignore[arg-type]
        for _ in range(2):  # the second round reuses both staging sets and their events
            wants = [wanted == "all" or i % 2 == 0 for i in range(len(prompts))]
            outs = eng.generate(input_ids=prompts, sampling_params=greedy(9), return_routed_experts=wants)
            for p, o, w in zip(prompts, outs, wants, strict=True):
                if w:
                    assert_routes_exact(tiny_ckpt, p, o)
                else:
                    assert "routed_experts" not in o["meta_info"]
