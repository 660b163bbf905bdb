"""Decode under CUDA graphs: one graph per batch size, replayed with the batch copied into static inputs.

An eager decode step of a DeepSeek model is hundreds of small launches (per layer: norms, MLA
projections, RoPE, the cache write, attention, the router, the capturer's slice write, fused MoE), so at
small batch the GPU waits on the host. A graph replays them in one launch. Everything inside is
sync-free by construction: attention takes its split count from host lengths (fixed per graph, sized
for the longest context), fused MoE and top-k never read device values on the host, and route capture
is a slice write into the capturer's static device buffer; the capturer's copy to the host runs after
the replay, outside the graph, exactly as in eager mode.

A batch of B requests runs on the smallest captured size >= B; padding rows decode token 0 at position
0 into the pool's reserved padding slot, attend to one key, and are never read back.
Shape legend: B requests (one new token each), V vocab, C latent cache row, L layers.
"""

from __future__ import annotations

import torch

from .forward_batch import ForwardBatch
from .model import DeepseekForCausalLM


class DecodeGraphs:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_buffer: torch.Tensor,
        req_to_token: torch.Tensor,
        batch_sizes: tuple[int, ...],
        max_context_len: int,
        pad_slot: int,
    ) -> None:
        if not batch_sizes:
            raise ValueError("DecodeGraphs needs at least one batch size")
        self.model = model
        self.kv_buffer = kv_buffer
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.pad_slot = pad_slot
        device = kv_buffer.device
        n = self.max_bs

        def zeros() -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.out_cache_loc = zeros(), zeros(), zeros()
        self.req_pool_indices, self.seq_lens, self.prefix_lens = zeros(), zeros(), zeros()
        self.extend_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)  # extend_start_loc and logits rows
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory pool
            self.graphs[bs] = self._capture(bs, req_to_token, max_context_len)

    def _static_batch(self, bs: int, req_to_token: torch.Tensor, max_context_len: int) -> ForwardBatch:
        # Host lengths only choose kernel parameters (the decode split count): the longest context, so one
        # graph serves every length. Device lengths are what the kernels read at replay.
        return ForwardBatch(
            forward_id=-1, mode="decode", input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], prefix_lens=self.prefix_lens[:bs], extend_lens=self.extend_lens[:bs],
            extend_start_loc=self.rows[:bs], req_to_token=req_to_token, logits_indices=self.rows[:bs],
            seq_lens_cpu=[max_context_len] * bs, prefix_lens_cpu=[max_context_len - 1] * bs,
            extend_lens_cpu=[1] * bs,
        )

    def _capture(
        self, bs: int, req_to_token: torch.Tensor, max_context_len: int
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        fb = self._static_batch(bs, req_to_token, max_context_len)
        self._pad(0, bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                self.model.compute_logits(fb, self.kv_buffer)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            logits = self.model.compute_logits(fb, self.kv_buffer)  # [bs, V] fp32, a static output
        return graph, logits

    def _pad(self, lo: int, hi: int) -> None:
        """Rows lo..hi-1 decode token 0 at position 0 into the padding slot, attending to one key."""
        if hi <= lo:
            return
        self.input_ids[lo:hi] = 0
        self.positions[lo:hi] = 0
        self.out_cache_loc[lo:hi] = self.pad_slot
        self.req_pool_indices[lo:hi] = 0
        self.seq_lens[lo:hi] = 1
        self.prefix_lens[lo:hi] = 0

    def can_run(self, fb: ForwardBatch) -> bool:
        """Decode batches that fit a graph, with no forced routes and logits exactly one per request."""
        return (
            fb.mode == "decode" and fb.batch_size <= self.max_bs and fb.replay is None
            and fb.logits_indices.shape[0] == fb.batch_size
        )

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """fb: a decode batch of B <= max_bs requests -> logits [B, V] fp32 (a view of the graph's output)."""
        b = fb.batch_size
        bs = next(s for s in self.batch_sizes if s >= b)
        self.input_ids[:b].copy_(fb.input_ids)
        self.positions[:b].copy_(fb.positions)
        self.out_cache_loc[:b].copy_(fb.out_cache_loc)
        self.req_pool_indices[:b].copy_(fb.req_pool_indices)
        self.seq_lens[:b].copy_(fb.seq_lens)
        self.prefix_lens[:b].copy_(fb.prefix_lens)
        self._pad(b, bs)
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits[:b]
