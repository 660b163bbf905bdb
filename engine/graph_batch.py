"""GraphBatch: the static inputs a CUDA graph reads, for up to max_bs requests of exactly n new tokens each, and how
a real batch is copied into them with its padding.

Shape legend: B requests of the real batch, bs the captured batch size (the smallest on the ladder >= B), n tokens a
request (1: a decode; d + 1: a speculative verify), T = B * n real rows, bs * n captured rows, C latent cache row.

A graph replays kernels with the addresses and host-chosen parameters of its capture, so everything a forward reads
lives here at fixed addresses: token ids, positions and KV slots [max_bs * n]; request rows, lengths and first rows
[max_bs]. `load` copies the real batch into rows [0, T) and requests [0, B) and pads the rest:
  padding request r in [B, bs): prefix 0, n tokens of id 0 at positions 0..n-1, every KV write to the pool's padding
  slot (never handed out), req_to_token row 0 read (any row is valid memory; only the padding's keys come from it).
Every op of a forward is per row (linears, norms, the router, the experts) or per request (attention), so a padding
row changes no real row; in exact mode (deterministic=True) a real row's bits do not depend on its batch at all, so
the graph's real rows equal the eager forward's bit for bit. Padding rows' outputs and routes sit past row T of every
output and of the capture buffer: route capture copies the batch's route_rows, [0, T), exactly as in eager mode.

Host lengths of the static batch only choose kernel parameters: the longest context (decode split counts; exact
attention's key window, masked on the device by each request's prefix length) and n (the extend grid).
"""

from __future__ import annotations

import torch

from .forward_batch import ForwardBatch, ForwardMode


class GraphBatch:
    def __init__(self, max_bs: int, tokens: int, pad_slot: int, max_context_len: int,
                 device: torch.device | str) -> None:
        if max_bs < 1 or tokens < 1:
            raise ValueError(f"GraphBatch: max_bs={max_bs}, tokens={tokens}; both must be >= 1")
        if tokens > max_context_len:
            raise ValueError(f"GraphBatch: {tokens} tokens a request exceed max_context_len={max_context_len}")
        self.max_bs, self.tokens, self.pad_slot, self.max_context_len = max_bs, tokens, pad_slot, max_context_len
        # n == 1 is a decode batch (one new token after a prefix); n > 1 runs as an extend (a verify)
        self.mode: ForwardMode = "decode" if tokens == 1 else "extend"
        rows = max_bs * tokens

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.out_cache_loc = zeros(rows), zeros(rows), zeros(rows)  # [max_bs * n]
        self.req_pool_indices, self.seq_lens, self.prefix_lens = zeros(max_bs), zeros(max_bs), zeros(max_bs)
        self.extend_lens = torch.full((max_bs,), tokens, dtype=torch.int64, device=device)  # [max_bs]
        self.extend_start_loc = torch.arange(max_bs, dtype=torch.int64, device=device) * tokens  # [max_bs]
        self.rows = torch.arange(rows, dtype=torch.int64, device=device)  # logits rows: every row
        self._pad_positions = self.rows % tokens  # [max_bs * n]: 0..n-1 in each request's rows

    def static(self, bs: int, req_to_token: torch.Tensor) -> ForwardBatch:
        """The batch a graph of bs requests is captured with: views of the static inputs, logits at every row."""
        t, n, longest = bs * self.tokens, self.tokens, self.max_context_len
        return ForwardBatch(
            forward_id=-1, mode=self.mode, input_ids=self.input_ids[:t], positions=self.positions[:t],
            out_cache_loc=self.out_cache_loc[:t], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], prefix_lens=self.prefix_lens[:bs], extend_lens=self.extend_lens[:bs],
            extend_start_loc=self.extend_start_loc[:bs], req_to_token=req_to_token, logits_indices=self.rows[:t],
            seq_lens_cpu=[longest] * bs, prefix_lens_cpu=[longest - n] * bs, extend_lens_cpu=[n] * bs,
            phases=["decode" if n == 1 else "verify"] * bs, lead_requests=bs, lead_rows=t,
        )

    def fits(self, fb: ForwardBatch) -> str | None:
        """None when fb can run on this batch's graphs, else why not (one line)."""
        if fb.mode != self.mode:
            return f"mode {fb.mode}, the graphs run {self.mode}"
        if not 0 < fb.batch_size <= self.max_bs:
            return f"{fb.batch_size} requests, the graphs hold 1..{self.max_bs}"
        if any(n != self.tokens for n in fb.extend_lens_cpu):
            return f"extend lengths {sorted(set(fb.extend_lens_cpu))}, the graphs run {self.tokens} a request"
        if fb.replay is not None:
            return "forced routes (a replay plan is per row and per forward)"
        if fb.dp_layout is not None:
            return "DP attention (a host count every forward)"
        return None

    def load(self, fb: ForwardBatch, bs: int) -> None:
        """Copy fb (B <= bs requests of n tokens, `fits`) into the static inputs and pad requests B..bs-1."""
        b, n = fb.batch_size, self.tokens
        t = b * n
        if fb.num_tokens != t or not b <= bs <= self.max_bs:
            raise ValueError(f"GraphBatch.load: {fb.num_tokens} rows of {b} requests into {bs} x {n}")
        self.input_ids[:t].copy_(fb.input_ids)
        self.positions[:t].copy_(fb.positions)
        self.out_cache_loc[:t].copy_(fb.out_cache_loc)
        self.req_pool_indices[:b].copy_(fb.req_pool_indices)
        self.seq_lens[:b].copy_(fb.seq_lens)
        self.prefix_lens[:b].copy_(fb.prefix_lens)
        self.pad(b, bs)

    def pad(self, lo: int, hi: int) -> None:
        """Requests lo..hi-1 (and their rows) become padding; pad(0, bs) is what a graph is captured on."""
        if hi <= lo:
            return
        n = self.tokens
        rows = slice(lo * n, hi * n)
        self.input_ids[rows] = 0
        self.positions[rows].copy_(self._pad_positions[rows])
        self.out_cache_loc[rows] = self.pad_slot
        self.req_pool_indices[lo:hi] = 0
        self.seq_lens[lo:hi] = n
        self.prefix_lens[lo:hi] = 0
