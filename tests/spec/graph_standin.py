"""A CUDA graph's contract without CUDA, so the graph paths (static inputs, padding, output views, the recorder hooks
around a replay) run on the CPU.

A stand-in, not the real thing (CUDA graphs cannot run here): `replay_eagerly(fn)` runs fn once as the capture and
re-runs it on every replay, copying the results into the first call's output tensors. fn reads the same static
inputs and the same host-side kernel parameters (the static batch's lengths) as a captured graph would, so
everything but the capture itself is the code the GPU runs. What only a GPU can show (no host sync inside, the memory
pool, replay of the recorded kernels) is in tests/spec/test_spec_graphs_gpu.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from r3trace.engine import Engine
from r3trace.engine.cuda_graph import DecodeGraphs, Outputs
from r3trace.engine.layers.moe import MoE, make_experts_fn
from r3trace.engine.spec.graphs import SpecGraphs


def replay_eagerly(fn: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
    with torch.inference_mode():
        outputs = fn()

    def replay() -> None:
        with torch.inference_mode():
            for out, new in zip(outputs, fn(), strict=True):
                out.copy_(new)

    return replay, outputs


def graph_experts(engine: Engine, *modules: torch.nn.Module) -> None:
    """The experts an engine built with cuda_graph_batch_sizes runs (make_experts_fn(..., graphs=True): in exact mode
    the sync-free ones), in every MoE of the given modules."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, MoE):
                m.experts_fn = make_experts_fn(engine.config.moe_impl, engine.model_config, engine.config.torch_dtype,
                                               graphs=True)


def install_spec_graphs(engine: Engine, batch_sizes: tuple[int, ...]) -> SpecGraphs:
    """Build a speculative engine's SpecGraphs with the stand-in (on its scheduler thread) and hand them to its
    runner, as EngineCore does on CUDA (test only: CPU engines capture no graphs)."""
    core, runner = engine.core, engine.runner
    graph_experts(engine, engine.model, runner.drafter.draft)

    def build() -> SpecGraphs:
        graphs = SpecGraphs(engine.model, runner.drafter, engine.kv_pool.kv_buffer, runner.req_pool.req_to_token,
                            batch_sizes, engine.max_context_len, engine.kv_pool.pad_slot, capture=replay_eagerly,
                            launch_steps=engine.config.speculative_launch_steps)
        runner.spec_graphs = graphs
        # as for an engine built with graphs (EngineConfig.launch_steps), whose capture buffer holds a launch's rows
        launch = engine.config.speculative_launch_steps
        core.scheduler.verifies.launch_steps = launch
        rows = launch * graphs.max_bs * graphs.tokens
        assert engine.capturer is None or engine.capturer.buffers.dev_ids.shape[1] >= rows, "capture buffer too small"
        return graphs

    return core.loop.call(build)


def install_decode_graphs(engine: Engine, batch_sizes: tuple[int, ...]) -> DecodeGraphs:
    """The same for a plain engine's decode graphs."""
    core, runner = engine.core, engine.runner
    graph_experts(engine, engine.model)

    def build() -> DecodeGraphs:
        runner.graphs = DecodeGraphs(engine.model, engine.kv_pool.kv_buffer, runner.req_pool.req_to_token,
                                     batch_sizes, engine.max_context_len, engine.kv_pool.pad_slot,
                                     capture=replay_eagerly)
        return runner.graphs

    return core.loop.call(build)
