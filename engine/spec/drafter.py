"""Drafter: the NextN layer's latent cache and every request row's draft state, and the two kinds of draft forward.

Shape legend: R request rows (req_to_token's), d speculative_num_steps, T tokens, B requests, D hidden, V vocab,
S KV slots, C latent cache row.

A request row r holds, between steps, what the next verify needs: tokens[r, 0] = x_1, the draft after the last
committed token; hidden[r] the draft's output h' at its position; probs[r, 0] = q_1 (sampled requests). The step:
  chain:  d' - 1 forwards of one token a request at the verify positions m .. m + d' - 2 (their KV slots are already
          allocated): x_j and h' in, x_{j+1} and the new h' out. The draft cache at those slots holds draft-on-draft
          rows until the extend below rewrites the accepted ones.
  extend: after the target forward, the draft runs over that forward's positions (a prefill chunk, or a verify's
          d' + 1 rows) with the target's hidden states and the next token of each position (the input of the row
          after it; at the last accepted row the token the verify committed); its output at that row proposes the
          next x_1. Rows past the accepted ones read rejected inputs and are never used: their slots are freed.
Each of the two runs through a DraftForwards: the Drafter itself (eager) or SpecGraphs (the same forward replayed
from a CUDA graph, spec/graphs.py); the drafts are chosen from its logits the same way either way.
Every draft forward runs the NextN layer only (no target recorder hook: the draft's router has its own
NullRecorder, nextn.check_draft_capture). Every position the target computes gets its draft row in the same step, so
a prefix-cache hit finds draft rows beside the target's KV; the hit's last row read the next token of the request
that computed it, which may differ from this request's. Only the draft's proposals (acceptance) can move with that,
never a committed token: those are the target's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from ..forward_batch import ForwardBatch
from ..model import DeepseekForCausalLM
from ..request import SamplingParams
from ..sampling import Sampler
from ..step import ScheduledReq
from .nextn import NextNDraft


class Drafter:
    def __init__(
        self, draft: NextNDraft, target: DeepseekForCausalLM, sampler: Sampler, kv_rows: int, req_rows: int,
        steps: int, device: str,
    ) -> None:
        """kv_rows: the target pool's slots (S + 1, with its padding slot); req_rows: R; steps: d."""
        cfg, ecfg = target.config, target.engine_config
        self.draft = draft
        self.target = target
        self.sampler = sampler
        self.steps = steps
        self.kv = torch.zeros(kv_rows, cfg.kv_cache_dim, dtype=ecfg.torch_dtype, device=device)  # [S + 1, C]
        # One row past the R request rows: `spare_row`, where a CUDA graph's padding requests store their drafts
        # (a graph of bs requests writes bs rows whatever the batch; spec/greedy_step.py), never read for a request.
        self.spare_row = req_rows
        self.tokens = torch.zeros(req_rows + 1, steps, dtype=torch.int64, device=device)  # [R + 1, d]
        self.hidden = torch.zeros(req_rows + 1, cfg.hidden_size, dtype=ecfg.torch_dtype, device=device)  # [R + 1, D]
        # [R, d, V] fp32 q_j of sampled drafts (the residual at a rejection needs all of q): R * d * V * 4 bytes,
        # 99 MB at DeepSeek-V3's V = 129280 with R = 64, d = 3
        self.probs = torch.zeros(req_rows, steps, cfg.vocab_size, dtype=torch.float32, device=device)

    def run(self, fb: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """One draft forward: input_ids [T] (x_{t+1}), hidden [T, D] (h_t) -> h' [T, D]."""
        model = self.target.model
        embedded = model.vocab_comm.reduce_embedding(model.embed_tokens(input_ids))
        return self.draft(fb, embedded, hidden, self.kv)

    # ---------------------------------------------------------------- DraftForwards, eager (spec/graphs.py: replayed)
    def chain_forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain step: fb a decode batch of B requests whose input_ids are x_j, hidden [B, D] their h' ->
        (the new h' [B, D], the head's logits [B, V] fp32)."""
        out = self.run(fb, fb.input_ids, hidden)
        return out, self.target.logits(out)

    def extend_forward(self, fb: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The draft over a target forward fb's rows: input_ids [T] each row's next token, hidden [T, D] the
        target's -> h' [T, D]."""
        return self.run(dataclasses.replace(fb, input_ids=input_ids, replay=None), input_ids, hidden)

    # ---------------------------------------------------------------- drafts
    def choose(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's logits [B, V] fp32 -> (draft tokens [B] int64, their distributions q [B, V] fp32, None when
        every row is greedy): argmax for greedy rows and a draw from q (Sampler.probs: the request's temperature,
        top-k, top-p) for the others."""
        greedy = logits.argmax(dim=-1)
        if all(p.is_greedy for p in params):
            return greedy, None
        q = self.sampler.probs(logits, params)
        drawn = self.sampler.race(q, generators)
        is_greedy = self.sampler.staging.to_device(np.array([p.is_greedy for p in params], np.bool_))  # [B]
        return torch.where(is_greedy, greedy, drawn), q

    def store(self, rows: torch.Tensor, step: int, tokens: torch.Tensor, q: torch.Tensor | None,
              hidden: torch.Tensor) -> None:
        """Draft `step` (0-based) of request rows [B]: tokens [B], q [B, V] or None, h' [B, D]."""
        self.tokens[:, step].index_copy_(0, rows, tokens)
        self.hidden.index_copy_(0, rows, hidden)
        if q is not None:
            self.probs[:, step].index_copy_(0, rows, q)

    def chain(self, items: list[ScheduledReq], forward_id: int, req_to_token: torch.Tensor, device: str,
              stage: Callable[[np.ndarray], torch.Tensor], forwards: DraftForwards | None = None) -> None:
        """Drafts x_2 .. x_{d'} of each verify item (x_1 came from the last extend): one forward a draft depth.
        forwards: where the forwards run (the step's CUDA graphs; None: eagerly, here)."""
        fwd = forwards or self
        for j in range(1, max((it.draft_len for it in items), default=0)):
            sub = [it for it in items if it.draft_len > j]  # requests that need x_{j+1}
            fb = ForwardBatch.build(
                forward_id=forward_id, input_ids=[0] * len(sub), prefix_lens=[it.start + j - 1 for it in sub],
                extend_lens=[1] * len(sub), req_pool_indices=[it.req.pool_row for it in sub],
                out_cache_loc=np.array([it.out_cache_loc[j - 1] for it in sub], np.int64), req_to_token=req_to_token,
                logits_rows=[], device=device, stage=stage,
            )
            rows = fb.req_pool_indices
            torch.index_select(self.tokens[:, j - 1], 0, rows, out=fb.input_ids)
            out, logits = fwd.chain_forward(fb, self.hidden.index_select(0, rows))  # [B, D], [B, V]
            tokens, q = self.choose(logits, [it.req.params for it in sub], [it.req.generator for it in sub])
            self.store(rows, j, tokens, q, out)

    def extend(self, fb: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor, out_rows: torch.Tensor,
               req_rows: torch.Tensor, samplers: list[ScheduledReq], forwards: DraftForwards | None = None) -> None:
        """After a target forward fb: the draft over its positions. input_ids [T]: each row's next token; hidden
        [T, D]: the target's; out_rows [B]: the row of each sampling request whose output proposes its next x_1;
        req_rows [B]: their request rows. forwards: as in chain."""
        out = (forwards or self).extend_forward(fb, input_ids, hidden)  # [T, D]
        if not samplers:
            return
        last = out.index_select(0, out_rows)  # [B, D]
        params, generators = [it.req.params for it in samplers], [it.req.generator for it in samplers]
        tokens, q = self.choose(self.target.logits(last), params, generators)
        self.store(req_rows, 0, tokens, q, last)


class DraftForwards(Protocol):
    """Where a step's draft forwards run: Drafter itself (eager) or SpecGraphs (replayed CUDA graphs)."""

    def chain_forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def extend_forward(self, fb: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor: ...
