"""A scripted multi-step workload for the parallel model tests: each DP rank's own requests, prefills then
decode steps over its own KV pool, some steps idle, run through the model with a real RoutedExpertsCapturer.

`run_workload` runs one rank (or, with dp_size 1, one process running every request) and returns what the
tests compare: per-forward logits of every request row, the rows the capturer returns for each request, the
routes the router really computed on this rank's rows (a ListRecorder beside the capturer), and near-tie gaps.

Shape legend: T tokens of a forward, L layers, M MoE layers, K top-k, V vocab, C latent cache row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from r3trace.capture.capturer import CaptureConfig, RoutedExpertsCapturer
from r3trace.capture.recorder import BatchView, ListRecorder, RowRange
from r3trace.engine.dp_layout import gather_dp_layout
from r3trace.engine.forward_batch import ForwardBatch, ReplayPlan
from r3trace.engine.model import DeepseekForCausalLM
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.near_tie import gap_hooks
from r3trace.engine.parallel import ParallelInfo

Kind = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Request:
    rid: str
    dp_rank: int
    prompt_len: int
    want: bool = True  # asks for its routes; False: its rows must never be copied to the host


REQUESTS = [
    Request("r0a", 0, 7), Request("r0b", 0, 5, want=False), Request("r1a", 1, 9), Request("r1b", 1, 4),
    Request("r1c", 1, 6),
]  # fmt: skip
# step -> {dp rank: (kind, request ids)}; a rank missing from a step is idle there. The padding modes each step
# resolves to: sum (both prefill), max, max with rank 1 idle, max with a padding row on rank 0 (1 vs 2 tokens),
# sum with rank 0 idle, max.
STEPS: list[dict[int, tuple[Kind, list[str]]]] = [
    {0: ("prefill", ["r0a", "r0b"]), 1: ("prefill", ["r1a", "r1b"])},
    {0: ("decode", ["r0a", "r0b"]), 1: ("decode", ["r1a", "r1b"])},
    {0: ("decode", ["r0a", "r0b"])},
    {0: ("decode", ["r0a"]), 1: ("decode", ["r1a", "r1b"])},
    {1: ("prefill", ["r1c"])},
    {0: ("decode", ["r0a", "r0b"]), 1: ("decode", ["r1a", "r1b", "r1c"])},
]
# replay: (step, request id) -> the positions of that forward whose routes are forced (rank 1 has no plan at
# step 0 and rank 0 none at step 3: the other ranks still gather the plan)
FORCED = {(0, "r0a"): [1, 4, 6], (1, "r1b"): [4], (3, "r1a"): [10]}
VOCAB = 320
MAX_CTX = 16


def token(rid: str, pos: int) -> int:
    """The token at a position: the prompt's and the 'sampled' ones alike, seeded by (request, position)."""
    return random.Random(f"{rid}/{pos}").randrange(2, VOCAB)


def forced_ids(rid: str, pos: int, num_layers: int, top_k: int, num_experts: int) -> list[list[int]]:
    """Distinct experts per layer for a forced row, seeded."""
    rng = random.Random(f"forced/{rid}/{pos}")
    return [rng.sample(range(num_experts), top_k) for _ in range(num_layers)]


class Tee:
    """The RouteRecorder protocol fanned out to several recorders (route_buffer: none, each copies)."""

    def __init__(self, *recorders: Any) -> None:
        self.recorders = recorders

    def on_forward_begin(self, batch: BatchView) -> None:
        for r in self.recorders:
            r.on_forward_begin(batch)

    def route_buffer(self, layer_id: int, num_tokens: int, row0: int = 0) -> torch.Tensor | None:
        return None

    def capture(self, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                row0: int = 0) -> None:
        for r in self.recorders:
            r.capture(layer_id, topk_ids, topk_weights, row0=row0)

    def on_forward_end(self, batch: BatchView) -> None:
        for r in self.recorders:
            r.on_forward_end(batch)


class _RowsFromZero:
    """A batch whose route_rows start at 0 whatever its DP layout says: what a capturer that assumes [0, n)
    reads (the mutation the tests must catch)."""

    def __init__(self, batch: BatchView) -> None:
        self._batch = batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    @property
    def route_rows(self) -> RowRange:
        return RowRange(0, self._batch.num_tokens)


class RowStartBlindCapturer(RoutedExpertsCapturer):
    def on_forward_end(self, batch: BatchView) -> None:
        super().on_forward_end(_RowsFromZero(batch))  # type: ignore[arg-type]


def capture_config(cfg: ModelConfig, parallel: ParallelInfo) -> CaptureConfig:
    return CaptureConfig(
        num_hidden_layers=cfg.num_hidden_layers, moe_layer_ids=tuple(cfg.moe_layer_ids),
        top_k=cfg.num_experts_per_tok, num_experts=cfg.n_routed_experts, kv_slots=len(REQUESTS) * MAX_CTX,
        max_batch_tokens=64,
        chunked_prefill_size=32, max_running_requests=8, dp_size=parallel.dp_size,
        attn_tp_size=parallel.attn_tp_size,
    )  # fmt: skip


def run_workload(
    model: DeepseekForCausalLM, parallel: ParallelInfo, capturer: RoutedExpertsCapturer, replay: bool = False,
    margins: bool = False, blind: RowStartBlindCapturer | None = None,
) -> dict[str, Any]:
    """Run STEPS for this rank's DP rank (every request when dp_size is 1). model.recorder must be
    Tee(capturer, ListRecorder()[, blind])."""
    cfg = model.config
    mine = [r for r in REQUESTS if parallel.dp_size == 1 or r.dp_rank == parallel.dp_rank]
    row = {r.rid: i for i, r in enumerate(mine)}
    r2t = torch.zeros(len(mine), MAX_CTX, dtype=torch.int32)
    slots_of: dict[str, list[int]] = {r.rid: [] for r in mine}
    kv = torch.zeros(cfg.num_hidden_layers, len(mine) * MAX_CTX, cfg.kv_cache_dim)
    for r in mine:
        capturer.add_request(r.rid, want=r.want)
        if blind is not None:
            blind.add_request(r.rid, want=r.want)
    truth: dict[str, list[np.ndarray]] = {r.rid: [] for r in mine}
    gaps: dict[str, list[np.ndarray]] = {r.rid: [] for r in mine}
    logits_out: dict[tuple[int, str], torch.Tensor] = {}
    routed: list[np.ndarray] = []  # per step: the real rows of the whole routed batch, [N_real, M, K]
    store: dict[int, torch.Tensor] = {}
    if margins:
        gap_hooks(model, store, "order")
    listing = next(r for r in model.recorder.recorders if isinstance(r, ListRecorder))  # type: ignore[attr-defined]
    moe = list(cfg.moe_layer_ids)
    for step, actions in enumerate(STEPS):
        items = [(kind, rid) for d, (kind, rids) in sorted(actions.items()) for rid in rids if rid in row]
        ids: list[int] = []
        plan_rows: list[tuple[int, list[list[int]]]] = []
        pre, ext, locs, phases = [], [], [], []
        for kind, rid in items:
            start = len(slots_of[rid])
            n = next(r.prompt_len for r in mine if r.rid == rid) if kind == "prefill" else 1
            new = list(range(row[rid] * MAX_CTX + start, row[rid] * MAX_CTX + start + n))
            r2t[row[rid], start : start + n] = torch.tensor(new, dtype=torch.int32)
            for pos in FORCED.get((step, rid), []) if replay else []:
                plan_rows.append((len(ids) + pos - start, forced_ids(rid, pos, cfg.num_hidden_layers,
                                                                     cfg.num_experts_per_tok, cfg.n_routed_experts)))
            ids += [token(rid, p) for p in range(start, start + n)]
            slots_of[rid] += new
            pre.append(start)
            ext.append(n)
            locs += new
            phases.append(kind)
        plan = None
        if plan_rows:
            t = len(ids)
            forced = torch.zeros(t, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.int32)
            mask = torch.zeros(t, dtype=torch.bool)
            for r, f in plan_rows:
                forced[r], mask[r] = torch.tensor(f, dtype=torch.int32), True
            plan = ReplayPlan(forced, mask)
        layout = None
        if parallel.dp_size > 1:
            wish = "sum" if any(k == "prefill" for k, _ in items) else "max"
            layout = gather_dp_layout(len(ids), parallel, wish, replay=plan is not None)
        if items:
            fb = ForwardBatch.build(
                forward_id=step, input_ids=ids, prefix_lens=pre, extend_lens=ext,
                req_pool_indices=[row[rid] for _, rid in items], out_cache_loc=np.asarray(locs, np.int64),
                req_to_token=r2t, logits_rows=list(range(len(ids))), device="cpu",
                request_ids=[rid for _, rid in items], phases=phases, replay=plan,  # type: ignore[arg-type]
            )  # fmt: skip
            fb.dp_layout, fb.dp_rank = layout, parallel.dp_rank
        else:
            fb = ForwardBatch.idle(forward_id=step, req_to_token=r2t, device="cpu", dp_layout=layout,
                                   dp_rank=parallel.dp_rank)  # fmt: skip
        logits = model(fb, kv)
        own = fb.route_rows
        for lid in moe:  # the router's rows hold this rank's own rows (under EP: gathered back over attention-TP)
            n_routed = listing.routes[lid][0].shape[0]
            assert n_routed >= own.stop, f"layer {lid}: {n_routed} routed rows, this rank's are {own}"
        batch_ids = np.stack([listing.routes[lid][0].numpy() for lid in moe], axis=1)  # [N, M, K]
        if layout is not None and layout.moe_batch == "gathered":  # drop the padding rows
            batch_ids = np.concatenate([batch_ids[layout.start_of(d) : layout.start_of(d) + n]
                                        for d, n in enumerate(layout.counts)])  # fmt: skip
        routed.append(batch_ids)
        first = 0
        for (_kind, rid), n in zip(items, ext, strict=True):
            logits_out[(step, rid)] = logits[first : first + n].clone()
            rows = slice(own.start + first, own.start + first + n)
            truth[rid].append(np.stack([listing.routes[lid][0][rows].numpy() for lid in moe], axis=1))
            if margins:
                gaps[rid].append(np.stack([store[lid][rows].numpy() for lid in moe], axis=1))
            first += n
    captured = {}
    for r in mine:
        slots = np.asarray(slots_of[r.rid], np.int64)
        got = capturer.rows(r.rid, slots, 0, len(slots)).ids[:, moe]  # [n, M, K]
        never = bool((capturer.buffers.rows_forward[slots] == -1).all())  # no host copy of its rows, ever
        captured[r.rid] = (got, never)
        if blind is not None:
            captured["blind/" + r.rid] = (blind.rows(r.rid, slots, 0, len(slots)).ids[:, moe], False)
    return {
        "logits": logits_out,
        "routed": routed,
        "captured": captured,
        "truth": {rid: np.concatenate(v) for rid, v in truth.items()},
        "gaps": {rid: np.concatenate(v) for rid, v in gaps.items()} if margins else {},
    }
