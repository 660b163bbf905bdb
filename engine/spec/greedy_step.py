"""GreedyStep: a whole greedy speculative step (chain drafts, verify, acceptance, draft extend) on a graph's static
inputs, so SpecGraphs captures it as ONE CUDA graph a batch size.

Shape legend: bs the captured batch size, d speculative_num_steps, n = d + 1 rows a request, D hidden, V vocab,
R request rows.

The host loads only the verify batch (GraphBatch of n rows a request: row 0 of request b holds its last committed
token t_m, rows 1..d are overwritten here) and reads back one [bs, n + 1] int64 tensor: the target's argmax at each
verify row, then the committed count. Everything between runs on the device, in this order, with the same ops as
the eager step (SpecRunner.launch with Drafter.chain / extend and verify.accept_greedy), so in exact mode a real
request's tokens, routes and draft state are the eager step's bit for bit:
  chain   for j = 1..d-1: the decode batch of draft position m + j - 1 derived on the device from the verify batch
          (position row j - 1, its KV slot, prefix m + j - 1), x_j = tokens[r, j - 1] and h' = hidden[r] in,
          argmax -> tokens[r, j], h' -> hidden[r];
  verify  rows 1..d of each request <- tokens[r, 0..d-1], the target forward with logits at every row (copied into
          the shared logits buffer, which logprobs read after the replay);
  accept  accept_greedy: counts = the longest draft prefix equal to the target's argmax, + 1;
  extend  each row's next token (the next row's input; at the last accepted row the target's token), the NextN layer
          over the verify's rows, its output at the last accepted row -> the head's argmax = the next x_1, h'.
Padding requests (graph_batch.py: KV slot = the pool's padding slot, never a real request's) store into the
drafter's spare row instead of request row 0, so no real request's drafts move.

`chain` runs S such steps back to back (EngineConfig.speculative_launch_steps): between two, `advance` moves the
verify batch on the device by each request's committed count, as the host's next schedule would (positions, prefix
and sequence lengths + count, the new t_m = the last committed token, KV slots read from req_to_token, where the
scheduler reserved S x n positions a request), and step s writes its routes from capture row s x bs x n
(ForwardBatch.route_row0), so the host reads all S steps' results and rows after one wait.
"""

from __future__ import annotations

import torch

from ..forward_batch import ForwardBatch
from ..graph_batch import GraphBatch
from ..model import DeepseekForCausalLM
from .drafter import Drafter
from .verify import accept_greedy


class GreedyStep:
    def __init__(self, target: DeepseekForCausalLM, drafter: Drafter, kv_buffer: torch.Tensor,
                 chain_batch: GraphBatch, verify_batch: GraphBatch, pad_slot: int, logits: torch.Tensor,
                 out: torch.Tensor) -> None:
        """logits: the shared [max_bs * n, V] fp32 buffer; out: [max_bs, n + 1] int64 (tokens, then the count)."""
        self.target, self.drafter, self.kv_buffer = target, drafter, kv_buffer
        self.chain_batch, self.verify_batch = chain_batch, verify_batch
        self.pad_slot, self.logits, self.out = pad_slot, logits, out
        self.steps = drafter.steps
        device = kv_buffer.device
        self.full_lens = torch.full((verify_batch.max_bs,), self.steps, dtype=torch.int64, device=device)  # [max_bs]

    def __call__(self, bs: int, chain_fb: ForwardBatch, verify_fb: ForwardBatch, extend_fb: ForwardBatch,
                 extend_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on the static batches of size bs -> (out [bs, n + 1], logits [bs * n, V]): views of the shared
        buffers. extend_fb is verify_fb with input_ids = extend_ids [bs * n]."""
        out = self.out[:bs]
        self._step(bs, chain_fb, verify_fb, extend_fb, extend_ids, out)
        return out, self.logits[: bs * (self.steps + 1)]

    def chain(self, bs: int, chain_fb: ForwardBatch, verify_fbs: list[ForwardBatch], extend_fb: ForwardBatch,
              extend_ids: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor]:
        """len(verify_fbs) = S steps, verify_fbs[s] the static verify batch with route_row0 = s * bs * n, each after
        the one before has advanced the batch -> (out [S, bs, n + 1]: each step's tokens then count,)."""
        for s, verify_fb in enumerate(verify_fbs):
            if s:
                self.advance(bs, verify_fb.req_to_token, out[s - 1])
            self._step(bs, chain_fb, verify_fb, extend_fb, extend_ids, out[s])
        return (out,)

    def advance(self, bs: int, req_to_token: torch.Tensor, done: torch.Tensor) -> None:
        """The static verify batch after a step whose results are done [bs, n + 1] (tokens, count): every real
        request moves by its count (rows keep n tokens), padding requests stay where they are."""
        n, vb = self.steps + 1, self.verify_batch
        counts = done[:, n]  # [bs], 1..n
        slots = vb.out_cache_loc[: bs * n].view(bs, n)  # [bs, n]
        real = slots[:, 0] != self.pad_slot  # [bs]
        moved = torch.where(real, counts, 0)  # [bs]
        positions = vb.positions[: bs * n].view(bs, n)
        positions.add_(moved[:, None])
        vb.prefix_lens[:bs].add_(moved)
        vb.seq_lens[:bs].add_(moved)
        reserved = req_to_token[vb.req_pool_indices[:bs, None], positions].to(torch.int64)  # [bs, n]
        slots.copy_(torch.where(real[:, None], reserved, self.pad_slot))
        last = done[:, :n].gather(1, (counts - 1)[:, None])[:, 0]  # [bs] the last committed token: the next t_m
        vb.input_ids[: bs * n].view(bs, n)[:, 0].copy_(torch.where(real, last, 0))

    def _step(self, bs: int, chain_fb: ForwardBatch, verify_fb: ForwardBatch, extend_fb: ForwardBatch,
              extend_ids: torch.Tensor, out: torch.Tensor) -> None:
        d, n, dr = self.steps, self.steps + 1, self.drafter
        vb, cb = self.verify_batch, self.chain_batch
        first_slot = vb.out_cache_loc[: bs * n].view(bs, n)[:, 0]  # [bs]
        rows = torch.where(first_slot == self.pad_slot, dr.spare_row, vb.req_pool_indices[:bs])  # [bs]
        for j in range(1, d):
            cb.input_ids[:bs].copy_(dr.tokens[:, j - 1].index_select(0, rows))
            cb.positions[:bs].copy_(vb.positions[: bs * n].view(bs, n)[:, j - 1])
            cb.out_cache_loc[:bs].copy_(vb.out_cache_loc[: bs * n].view(bs, n)[:, j - 1])
            cb.req_pool_indices[:bs].copy_(vb.req_pool_indices[:bs])
            torch.add(vb.prefix_lens[:bs], j - 1, out=cb.prefix_lens[:bs])
            torch.add(vb.prefix_lens[:bs], j, out=cb.seq_lens[:bs])
            h, logits = dr.chain_forward(chain_fb, dr.hidden.index_select(0, rows))  # [bs, D], [bs, V]
            dr.store(rows, j, logits.argmax(dim=-1), None, h)
        ids = vb.input_ids[: bs * n].view(bs, n)  # [bs, n]
        ids[:, 1:].copy_(dr.tokens.index_select(0, rows)[:, :d])
        logits, hidden = self.target.compute_hidden(verify_fb, self.kv_buffer)  # [bs * n, V] fp32, [bs * n, D]
        self.logits[: bs * n].copy_(logits)
        target_ids = logits.argmax(dim=-1).view(bs, n)  # [bs, n]
        tokens, counts = accept_greedy(target_ids, ids[:, 1:], self.full_lens[:bs])
        last_rows = torch.arange(bs, device=ids.device) * n + counts - 1  # [bs] row of the last committed token
        next_ids = vb.input_ids[: bs * n].roll(-1)  # [bs * n] row r's next token is row r + 1's input
        next_ids.index_copy_(0, last_rows, tokens.gather(1, (counts - 1)[:, None])[:, 0])
        extend_ids.copy_(next_ids)
        h = dr.extend_forward(extend_fb, extend_ids, hidden).index_select(0, last_rows)  # [bs, D]
        dr.store(rows, 0, self.target.logits(h).argmax(dim=-1), None, h)
        out[:, :n].copy_(tokens)
        out[:, n].copy_(counts)
