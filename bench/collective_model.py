"""The bytes each collective moves per MoE layer, computed from the layout: bench/collective_bytes.py counts the same
calls on gloo ranks and checks them against this (tests/engine/test_collective_bytes.py).

Per call and per rank (a `Collective`): `sent`, the bytes of the tensor this rank hands to the collective;
`received`, the bytes of its output on this rank (its own share included); `wire`, the bytes that leave this rank:
a ring all-reduce 2 (R - 1) / R x payload, an all-gather (R - 1) x input, an all-to-all its input minus the rows it
keeps. The normal-mode all-to-all moves one row per (token, destination rank): its bytes depend on the routes,
computed from the routes the dispatcher got, the expectation under uniform routing, or the worst case per rank.

Shape legend: T tokens per DP rank, n = ceil(T / A) rows a rank's MoE sees under EP, D hidden, V vocab, E experts,
K top-k, R tp ranks, P dp ranks, A = R / P attention-TP ranks, G ep ranks, M the low-latency layout's rows per rank,
b the activation dtype's bytes, N rows a rank dispatches (one per (token, destination rank)), Q rows it receives.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

from r3trace.engine.model_config import ModelConfig

Mode = Literal["max", "sum"]  # DpLayout's padding mode: decode "max", prefill "sum"
Routes = Literal["uniform", "worst"]


@dataclass(frozen=True)
class Shape:
    hidden: int
    vocab: int
    experts: int
    top_k: int
    n_group: int
    topk_group: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> Shape:
        return cls(cfg.hidden_size, cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                   max(cfg.n_group, 1), max(cfg.topk_group, 1))  # fmt: skip


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    ep: int = 1
    dispatcher: Literal["normal", "low_latency"] = "normal"
    ll_rows: int = 0  # M: the low-latency layout's rows per rank (engine: model.moe_rows_per_rank)

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp


class RankRows(NamedTuple):
    """Real routes of one layer, for one EP rank: rows it sends to each EP rank and receives from each."""

    send: tuple[int, ...]  # [G]
    recv: tuple[int, ...]  # [G]
    rank: int  # this rank's index in the EP group


class Collective(NamedTuple):
    stage: str  # the engine function that calls it: prepare_mlp, dispatch, combine, postprocess_layer, ...
    op: str  # all_reduce | all_gather | all_to_all
    group: str  # tp | attn_tp | dp | ep | cpu
    ranks: int
    sent: float  # bytes this rank hands in
    received: float  # bytes of the output on this rank
    wire: float  # bytes leaving this rank (ring all-reduce, ring all-gather, all-to-all minus the kept rows)


class LayerBytes(NamedTuple):
    dense: list[Collective]  # one dense layer, in call order
    moe: list[Collective]  # one MoE layer, in call order
    forward: list[Collective]  # once a forward: DP layout, embedding, logits


def all_reduce(stage: str, group: str, r: int, payload: float, exact: bool) -> Collective:
    """A sum over r ranks; exact mode's exact_all_reduce is an all_gather of the r partials instead."""
    if exact:
        return Collective(stage, "all_gather", group, r, payload, r * payload, (r - 1) * payload)
    return Collective(stage, "all_reduce", group, r, payload, payload, 2 * (r - 1) * payload / r)


def all_gather(stage: str, group: str, r: int, part: float) -> Collective:
    return Collective(stage, "all_gather", group, r, part, r * part, (r - 1) * part)


def reach_probability(shape: Shape, g: int) -> float:
    """P(a token reaches a given EP rank) under uniform routing: topk_group of n_group groups uniformly, then K of
    their experts uniformly; rank r holds experts [r E/G, (r + 1) E/G), a group [i E/n_group, ...). Mean over ranks."""
    e, k, ng, tg = shape.experts, shape.top_k, shape.n_group, shape.topk_group
    per_group, per_rank = e // ng, e // g
    total = 0.0
    subsets = list(itertools.combinations(range(ng), tg))
    for r in range(g):
        rank = set(range(r * per_rank, (r + 1) * per_rank))
        for s in subsets:
            pool = [x for i in s for x in range(i * per_group, (i + 1) * per_group)]
            outside = sum(x not in rank for x in pool)
            total += 1 - math.comb(outside, k) / math.comb(len(pool), k)
    return total / (g * len(subsets))


def worst_reach(shape: Shape, g: int) -> int:
    """The most EP ranks one token can reach: K experts inside topk_group groups (group-limited routing)."""
    per_group, per_rank = shape.experts // shape.n_group, shape.experts // g
    best = 0
    for s in itertools.combinations(range(shape.n_group), shape.topk_group):
        ranks = {x // per_rank for i in s for x in range(i * per_group, (i + 1) * per_group)}
        best = max(best, min(shape.top_k, len(ranks)))
    return best


def _a2a_rows(shape: Shape, g: int, n: int, routes: Routes | RankRows) -> tuple[float, float, float, float]:
    """(rows sent N, rows received Q, rows kept, of N, rows kept, of Q) for the normal-mode dispatch."""
    if isinstance(routes, RankRows):
        kept = routes.send[routes.rank]
        return sum(routes.send), sum(routes.recv), kept, routes.recv[routes.rank]
    if routes == "uniform":
        q = n * reach_probability(shape, g)  # rows to each rank, and from each (symmetric in expectation)
        return g * q, g * q, q, q
    # worst, per rank (bounds, not all reached at once): every token to worst_reach ranks, none of them this one
    # where that leaves enough; every token of every rank received here
    reach = worst_reach(shape, g)
    return n * reach, g * n, n * max(0, reach - (g - 1)), n


def collective_bytes(
    shape: Shape, layout: Layout, tokens: int, mode: Mode, dtype_bytes: int, exact: bool = False,
    routes: Routes | RankRows = "uniform", logit_rows: int | None = None, capture: bool = True,
) -> LayerBytes:  # fmt: skip
    """Every collective of one forward per rank, by layer kind, with T = tokens on every DP rank (equal counts).

    What the engine does (engine/communicator.py, dp_layout.py, layers/dispatcher.py, low_latency_dispatcher.py):
    prepare_mlp reduces o_proj over attention TP (SCATTERED: rows padded to n A) and, under DP attention with a TP
    MoE or a dense MLP (FULL), gathers the DP ranks' rows ("max": all-gather of [T, D]; "sum": all-reduce of
    [P T, D]); postprocess_layer all-reduces the TP-split part (dense MLP, separate shared experts) over TP, or under
    EP all-gathers hidden and residual over attention TP; under EP the route ids [n, 2K] int32 are all-gathered
    over attention TP (capture on) and the dispatcher exchanges rows. Exact mode: every all-reduce an all-gather."""
    d, b, k, e = shape.hidden, dtype_bytes, shape.top_k, shape.experts
    r, p, a, g = layout.tp, layout.dp, layout.attn_tp, layout.ep
    t = tokens
    n = -(-t // a)  # rows of a rank's scattered slice (SCATTERED)
    row = d * b

    def layer(moe: bool) -> list[Collective]:
        out: list[Collective] = []
        scattered = moe and g > 1
        if scattered:
            if a > 1:
                out.append(all_reduce("prepare_mlp", "attn_tp", a, n * a * row, exact))
            if a > 1 and capture:
                out.append(all_gather("route_gather", "attn_tp", a, n * 2 * k * 4))
            if layout.dispatcher == "normal":
                sent, got, kept_s, kept_r = _a2a_rows(shape, g, n, routes)
                out.append(Collective("dispatch", "all_to_all", "ep", g, g * 8, g * 8, (g - 1) * 8))  # counts int64
                for width in (2 * k * 4, row):  # ids + fp32 weight bits as int32, then the hidden rows
                    out.append(Collective("dispatch", "all_to_all", "ep", g, sent * width, got * width,
                                          (sent - kept_s) * width))  # fmt: skip
                out.append(Collective("combine", "all_to_all", "ep", g, got * row, sent * row, (got - kept_r) * row))
            else:
                m = layout.ll_rows
                out.append(Collective("dispatch", "all_to_all", "ep", g, e * 8, e * 8, (g - 1) * e * 8 / g))
                for stage in ("dispatch", "combine"):
                    out.append(Collective(stage, "all_to_all", "ep", g, e * m * row, e * m * row,
                                          (g - 1) * e * m * row / g))  # fmt: skip
            if a > 1:
                out += [all_gather("postprocess_layer", "attn_tp", a, n * row)] * 2  # hidden, residual
            return out
        if a > 1:
            out.append(all_reduce("prepare_mlp", "attn_tp", a, t * row, exact))
        rows = t
        if p > 1:  # FULL
            rows = p * t
            if mode == "max":
                out.append(all_gather("prepare_mlp", "dp", p, t * row))
            else:
                out.append(all_reduce("prepare_mlp", "dp", p, p * t * row, exact))
        if r > 1:  # the dense MLP, or the separate shared experts, split over TP (the engine's default on CPU)
            out.append(all_reduce("postprocess_layer", "tp", r, rows * row, exact))
        return out

    forward: list[Collective] = []
    if p > 1:
        forward.append(all_gather("dp_layout", "cpu", r, 3 * 8))
    if a > 1:
        forward.append(all_reduce("embed", "attn_tp", a, t * row, exact))
        forward.append(all_gather("logits", "attn_tp", a, (t if logit_rows is None else logit_rows)
                                  * (shape.vocab // a) * b))  # fmt: skip
    return LayerBytes(layer(False), layer(True), forward)
