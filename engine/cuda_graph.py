"""Decode under CUDA graphs: one graph per batch size, replayed with the batch copied into static inputs; and the
capture every graph of the engine goes through (engine/spec/graphs.py captures speculation's the same way).

An eager decode step of a DeepSeek model is hundreds of small launches (per layer: norms, MLA
projections, RoPE, the cache write, attention, the router, the capturer's slice write, fused MoE), so at
small batch the GPU waits on the host. A graph replays them in one launch. Everything inside is
sync-free by construction: attention takes its split count from host lengths (fixed per graph, sized
for the longest context), fused MoE and top-k never read device values on the host, and route capture
is a slice write into the capturer's static device buffer; the capturer's copy to the host runs after
the replay, outside the graph, exactly as in eager mode. Exact mode (deterministic=True) is sync-free too: its
attention reads the longest context's keys masked on the device, its experts run every pair at once.

A batch of B requests runs on the smallest captured size >= B; padding rows decode token 0 at position
0 into the pool's reserved padding slot, attend to one key, and are never read back (graph_batch.py).
Shape legend: B requests (one new token each), V vocab, C latent cache row, L layers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .forward_batch import ForwardBatch
from .graph_batch import GraphBatch
from .model import DeepseekForCausalLM

Outputs = tuple[torch.Tensor, ...]
# capture(fn) -> (replay, outputs): fn's work recorded once; replay() redoes it on whatever the static inputs hold,
# leaving the results in `outputs` (the same tensors every time)
Capture = Callable[[Callable[[], Outputs]], tuple[Callable[[], None], Outputs]]


class CudaGraphCapture:
    """Captures callables as CUDA graphs that share one memory pool: the engine replays one graph at a time, each
    graph's outputs stay allocated (they are referenced), so only temporaries are shared."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, fn: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            outputs = fn()
        self.graphs.append(graph)
        return graph.replay, outputs


def graph_size(batch_sizes: tuple[int, ...], b: int) -> int:
    """The smallest captured size >= b (batch_sizes sorted; b <= the largest)."""
    return next(s for s in batch_sizes if s >= b)


class DecodeGraphs:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        batch_sizes: tuple[int, ...],
        max_context_len: int,
        pad_slot: int,
        capture: Capture | None = None,
    ) -> None:
        """capture: CudaGraphCapture() when None."""
        if not batch_sizes:
            raise ValueError("DecodeGraphs needs at least one batch size")
        self.model = model
        self.kv_buffer = kv_buffer
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.batch = GraphBatch(self.max_bs, 1, pad_slot, max_context_len, kv_buffer.device)
        capture = capture or CudaGraphCapture()
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory pool
            fb = self.batch.static(bs, req_to_token)
            self.batch.pad(0, bs)
            replay, (logits,) = capture(partial(self._logits, fb))  # [bs, V]
            self.graphs[bs] = (replay, logits)

    def _logits(self, fb: ForwardBatch) -> Outputs:
        return (self.model.compute_logits(fb, self.kv_buffer),)

    def can_run(self, fb: ForwardBatch) -> bool:
        """Decode batches that fit a graph, with no forced routes and logits exactly one per request."""
        return self.batch.fits(fb) is None and fb.logits_indices.shape[0] == fb.batch_size

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """fb: a decode batch of B <= max_bs requests -> logits [B, V] fp32 (a view of the graph's output)."""
        bs = graph_size(self.batch_sizes, fb.batch_size)
        self.batch.load(fb, bs)
        replay, logits = self.graphs[bs]
        replay()
        return logits[: fb.batch_size]
