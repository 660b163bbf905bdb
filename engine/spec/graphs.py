"""SpecGraphs: a speculative step's three forwards as CUDA graphs, one set per batch size of the ladder.

Shape legend: B requests of the step, bs the captured size (the smallest on the ladder >= B), d speculative_num_steps,
n = d + 1 rows a request, D hidden, V vocab.

Per batch size, captured once when the engine is built (largest first, one shared memory pool: the three replay one
after another, never at once, and each keeps its outputs):
  chain   the NextN layer over one token a request (a decode batch of bs) and the head: h' [bs, D], logits [bs, V];
          replayed d - 1 times a step, once per draft depth (none when d = 1);
  verify  the target over n tokens a request (an extend of bs x n rows) with logits at every row and the final hidden
          states: logits [bs * n, V], hidden [bs * n, D]; the routers write route capture's device buffer inside it;
  extend  the NextN layer over the verify's rows: it reads the verify graph's static batch and hidden output in place,
          and its own token ids (each row's next token): h' [bs * n, D];
  step    a greedy step's whole work (greedy_step.py): the chain drafts, the verify, acceptance and the extend, read
          back as one [bs, n + 1] tensor. An all-greedy step replays this one graph instead of the three above: the
          eager glue between them (batch building, acceptance, choosing drafts) was ~1.8 ms of a 2.2 ms step at batch
          1 on the H200, the GPU work 0.38 ms;
  steps   with launch_steps S > 1: S greedy steps in one graph, the batch advanced on the device between them
          (GreedyStep.chain), read back as one [S, bs, n + 1] tensor; step s's routes from capture row s x bs x n.
The verify and chain graphs of every size copy their logits into one shared buffer (verify_logits, chain_logits).
Between the three replays of a sampled step the step runs eagerly as without graphs (SpecRunner): drafts from the
chain's logits, acceptance from the verify's, the draft ids for the extend, the next x_1 from the extend's output.

When a step runs on graphs (`can_run`): every item is a verify of exactly d drafts (uniform n rows a request: what the
scheduler gives every decoding request once the step's budget holds B x n tokens, EngineConfig.max_graph_batch),
B <= the largest size, no forced routes. Anything else (a prefill chunk in the step, a request near its context limit
or the step's token budget drafting fewer, routing replay) runs the eager path, which stays the reference; its chain
drafts still replay the chain graph when its verifies fit it (`can_chain`).

Route capture is what it is eagerly: on_forward_begin / on_forward_end run around the verify replay with the real
batch, whose route_rows are rows [0, B * n) of the buffer the graph wrote; padding rows (graph_batch.py) sit past them
and are never copied. The draft graphs hold only the NextN layer, whose router records into its own NullRecorder
(nextn.check_draft_capture, run before capture): no replay of theirs writes a target buffer. The greedy step graph
holds the target's verify between its draft forwards; its route writes are exactly a verify replay's
(tests/spec/test_spec_graphs_gpu.py compares the two).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import torch

from ..cuda_graph import Capture, CudaGraphCapture, graph_size
from ..forward_batch import ForwardBatch
from ..graph_batch import GraphBatch
from ..model import DeepseekForCausalLM
from ..step import ScheduledReq
from .drafter import Drafter
from .greedy_step import GreedyStep


class SpecGraphs:
    def __init__(
        self, target: DeepseekForCausalLM, drafter: Drafter, kv_buffer: torch.Tensor, req_to_token: torch.Tensor,
        batch_sizes: tuple[int, ...], max_context_len: int, pad_slot: int, capture: Capture | None = None,
        launch_steps: int = 1,
    ) -> None:
        """capture: CudaGraphCapture() when None (tests pass an eager stand-in to run these paths on the CPU);
        launch_steps: S > 1 also captures the S-step greedy graph of every size."""
        if not batch_sizes:
            raise ValueError("SpecGraphs needs at least one batch size")
        self.launch_steps = launch_steps
        self.steps = d = drafter.steps
        self.tokens = n = d + 1
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        device, dtype = kv_buffer.device, drafter.hidden.dtype
        self.chain_batch = GraphBatch(self.max_bs, 1, pad_slot, max_context_len, device)
        self.verify_batch = GraphBatch(self.max_bs, n, pad_slot, max_context_len, device)
        self.chain_hidden = torch.zeros(self.max_bs, drafter.hidden.shape[1], dtype=dtype, device=device)  # [bs, D]
        self.extend_ids = torch.zeros(self.max_bs * n, dtype=torch.int64, device=device)  # [bs * n]
        # One fp32 logits buffer for every size of the ladder (each graph copies its logits into its first rows):
        # a buffer a size would hold max_bs * n * V * 4 bytes each, ~0.8 GB over the ladder at DeepSeek-V3's V.
        vocab = target.config.vocab_size
        self.verify_logits = torch.zeros(self.max_bs * n, vocab, dtype=torch.float32, device=device)  # [max_bs * n, V]
        self.chain_logits = torch.zeros(self.max_bs, vocab, dtype=torch.float32, device=device)  # [max_bs, V]
        self.step_out = torch.zeros(self.max_bs, n + 1, dtype=torch.int64, device=device)  # [max_bs, n + 1]
        self.steps_out = torch.zeros(launch_steps, self.max_bs, n + 1, dtype=torch.int64, device=device)
        self._greedy = GreedyStep(target, drafter, kv_buffer, self.chain_batch, self.verify_batch, pad_slot,
                                  self.verify_logits, self.step_out)
        capture = capture or CudaGraphCapture()
        Replay = Callable[[], None]
        self._chain: dict[int, tuple[Replay, tuple[torch.Tensor, ...]]] = {}
        self._verify: dict[int, tuple[Replay, tuple[torch.Tensor, ...]]] = {}
        self._extend: dict[int, tuple[Replay, tuple[torch.Tensor, ...]]] = {}
        self._step: dict[int, tuple[Replay, tuple[torch.Tensor, ...]]] = {}
        self._steps: dict[int, tuple[Replay, tuple[torch.Tensor, ...]]] = {}
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory pool
            chain_fb = self.chain_batch.static(bs, req_to_token)
            if d > 1:
                self.chain_batch.pad(0, bs)
                self._chain[bs] = capture(partial(self._chain_outputs, drafter, chain_fb, self.chain_hidden[:bs]))
            verify_fb = self.verify_batch.static(bs, req_to_token)
            self.verify_batch.pad(0, bs)
            self._verify[bs] = capture(partial(self._verify_outputs, target, verify_fb, kv_buffer))
            hidden = self._verify[bs][1][1]  # [bs * n, D]: the verify graph's output, the extend graph's input
            extend_fb = dataclasses.replace(verify_fb, input_ids=self.extend_ids[: bs * n])
            self._extend[bs] = capture(partial(_extend_outputs, drafter, extend_fb, hidden))
            self.verify_batch.pad(0, bs)
            self._step[bs] = capture(partial(self._greedy, bs, chain_fb, verify_fb, extend_fb,
                                             self.extend_ids[: bs * n]))
            if launch_steps > 1:
                self.verify_batch.pad(0, bs)
                verify_fbs = [dataclasses.replace(verify_fb, route_row0=k * bs * n) for k in range(launch_steps)]
                self._steps[bs] = capture(partial(self._greedy.chain, bs, chain_fb, verify_fbs, extend_fb,
                                                  self.extend_ids[: bs * n], self.steps_out[:, :bs]))
        self._loaded: tuple[ForwardBatch, int] | None = None  # the verify batch now in the static inputs, its size
        self.replays = 0  # graph replays so far (tests check the graph path ran)
        self.graph_steps = 0  # steps run on graphs so far: greedy_step calls and verify_forward calls

    def can_run(self, items: list[ScheduledReq], replay: object) -> bool:
        """The step runs on graphs: 1..max_bs verify items of exactly d drafts each, no forced routes."""
        return (0 < len(items) <= self.max_bs and replay is None
                and all(it.phase == "verify" and it.draft_len == self.steps for it in items))

    def can_chain(self, verifies: list[ScheduledReq]) -> bool:
        """A step's chain drafts run on the chain graphs (whatever else the step holds): 1..max_bs verify items of
        exactly d drafts each."""
        return 0 < len(verifies) <= self.max_bs and all(it.draft_len == self.steps for it in verifies)

    def _chain_outputs(self, drafter: Drafter, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, logits = drafter.chain_forward(fb, hidden)
        b = logits.shape[0]
        self.chain_logits[:b].copy_(logits)
        return out, self.chain_logits[:b]

    def _verify_outputs(self, target: DeepseekForCausalLM, fb: ForwardBatch,
                        kv_buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, hidden = target.compute_hidden(fb, kv_buffer)
        t = logits.shape[0]
        self.verify_logits[:t].copy_(logits)
        return self.verify_logits[:t], hidden

    def greedy_step(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole greedy step (spec/greedy_step.py) in one replay, `can_run` and every request greedy: fb the verify
        batch (B requests of n rows; draft rows are filled on the device) -> (out [B, n + 1] int64: the target's
        argmax at each row then the committed count; logits [B * n, V] fp32), views valid until the next replay.
        The caller runs the recorder's begin / end hooks around it."""
        _check(self.verify_batch, fb)
        b = fb.batch_size
        bs = graph_size(self.batch_sizes, b)
        self.verify_batch.load(fb, bs)
        replay, (out, logits) = self._step[bs]
        replay()
        self.replays += 1
        self.graph_steps += 1
        self._loaded = None
        return out[:b], logits[: b * self.tokens]

    def greedy_steps(self, fb: ForwardBatch) -> tuple[torch.Tensor, int]:
        """launch_steps greedy steps in one replay, from the verify batch fb (as greedy_step) -> (out [S, B, n + 1]:
        each step's target argmax at each row then its committed count, a view valid until the next replay; bs, the
        graph size, whose step s wrote its routes from capture row s * bs * n). The caller runs the recorder's begin
        hook before it and its end hook per step once the results are on the host."""
        _check(self.verify_batch, fb)
        b = fb.batch_size
        bs = graph_size(self.batch_sizes, b)
        self.verify_batch.load(fb, bs)
        replay, (out,) = self._steps[bs]
        replay()
        self.replays += 1
        self.graph_steps += self.launch_steps
        self._loaded = None
        return out[:, :b], bs

    # ---------------------------------------------------------------- DraftForwards (drafter.py), replayed
    def chain_forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter.chain_forward on the chain graph: fb a decode batch of B requests, hidden [B, D] -> (h' [B, D],
        logits [B, V]): views of the graph's outputs, valid until its next replay."""
        _check(self.chain_batch, fb)
        b = fb.batch_size
        bs = graph_size(self.batch_sizes, b)
        self.chain_batch.load(fb, bs)
        self.chain_hidden[:b].copy_(hidden)
        if bs > b:
            self.chain_hidden[b:bs] = 0
        replay, (out, logits) = self._chain[bs]
        replay()
        self.replays += 1
        return out[:b], logits[:b]

    def verify_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepseekForCausalLM.compute_hidden on the verify graph: fb B requests of n rows, logits at every row ->
        (logits [B * n, V] fp32, hidden [B * n, D]). The caller runs the recorder's begin / end hooks around it."""
        _check(self.verify_batch, fb)
        t = fb.num_tokens
        if fb.logits_indices.shape[0] != t:
            raise ValueError(f"verify graph: logits at {fb.logits_indices.shape[0]} of {t} rows; it computes all")
        bs = graph_size(self.batch_sizes, fb.batch_size)
        self.verify_batch.load(fb, bs)
        replay, (logits, hidden) = self._verify[bs]
        replay()
        self.replays += 1
        self.graph_steps += 1
        self._loaded = (fb, bs)
        return logits[:t], hidden[:t]

    def extend_forward(self, fb: ForwardBatch, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter.extend_forward on the extend graph, right after verify_forward(fb): input_ids [T] each row's next
        token; hidden must be the verify graph's hidden output (the graph reads it in place) -> h' [T, D]."""
        if self._loaded is None or self._loaded[0] is not fb:
            raise RuntimeError("extend graph: replayed without the verify of the same batch just before it")
        bs = self._loaded[1]
        if hidden.data_ptr() != self._verify[bs][1][1].data_ptr():
            raise RuntimeError("extend graph: hidden is not the verify graph's output")
        t, hi = fb.num_tokens, bs * self.tokens
        self.extend_ids[:t].copy_(input_ids)
        if hi > t:
            self.extend_ids[t:hi] = 0
        replay, (out,) = self._extend[bs]
        replay()
        self.replays += 1
        self._loaded = None
        return out[:t]


def _extend_outputs(drafter: Drafter, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor]:
    return (drafter.extend_forward(fb, fb.input_ids, hidden),)


def _check(batch: GraphBatch, fb: ForwardBatch) -> None:
    why = batch.fits(fb)
    if why is not None:
        raise ValueError(f"speculation graph: {why}")
