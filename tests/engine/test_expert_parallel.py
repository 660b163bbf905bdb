"""Expert parallelism at the MoE layer: the dispatch layout, and ep2 / ep4 gloo processes against one process.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_expert_parallel.py (ep4 included; `make
test` skips it with the slow marker).

The layout is checked against pure Python loops. The distributed tests run real processes (gloo on CPU over
127.0.0.1); every rank holds its E/ep expert slice, feeds its own tokens (one rank none at all), and its MoE
output must match the one-process MoE with all experts on the same tokens.

fp32 tolerance of the outputs (1e-6 absolute, 1e-5 relative; outputs here are O(0.1)): the same products
are summed in another association, (p1 + p2) + (p3 + p4) across two ranks against ((p1 + p2) + p3) + p4 in one
process, and an expert's GEMM runs over another row count (every rank's tokens for that expert), which may
pick another BLAS blocking of the D = 48 and I = 24 dot products. Each is a few ulps of the |terms| summed
(K + 1 = 4 terms, eps = 1.2e-7); any misrouted row, lost weight or mis-ordered token is off by O(0.1).
The ids and weights that reach each rank are compared exactly.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bench.spawn import free_port, spawn_ranks
from r3trace.capture.recorder import NullRecorder
from r3trace.engine.expert_placement import apply_expert_location, update_expert_placement
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.layers.dispatcher import (
    AllToAllDispatcher,
    NullDispatcher,
    dispatch_layout,
    expert_slice,
    local_experts,
)
from r3trace.engine.layers.dispatcher_choice import make_dispatcher
from r3trace.engine.layers.expert_location import ExpertLocation, physical_expert_weights
from r3trace.engine.layers.expert_map import ExpertMap
from r3trace.engine.layers.low_latency_dispatcher import LowLatencyDispatcher
from r3trace.engine.layers.moe import MoE, make_experts_fn
from r3trace.engine.layers.router import make_routing_ops
from r3trace.engine.model_config import ModelConfig
from r3trace.kernels.moe.reference import fused_moe_ref

E, K = 8, 3

# a V3 MoE layer: sigmoid + noaux_tc, 4 groups of 2 experts, 2 groups per token, one shared expert
CFG = ModelConfig.from_dict(dict(
    model_type="deepseek_v3", vocab_size=64, hidden_size=48, intermediate_size=96, moe_intermediate_size=24,
    num_hidden_layers=1, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=12, n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=K, n_group=4, topk_group=2,
    routed_scaling_factor=2.5,
))  # fmt: skip


# ---------------------------------------------------------------- the layout, against loops


def layout_loops(ids: list[list[int]], weights: list[list[float]], num_experts: int, ep_size: int) -> dict[str, Any]:
    """The dispatch layout by brute force: for each rank in order, each token in order that has an expert there."""
    per = num_experts // ep_size
    send_rank, send_token, send_ids, send_weights = [], [], [], []
    for r in range(ep_size):
        for t in range(len(ids)):
            local = [e - r * per if e >= 0 and e // per == r else -1 for e in ids[t]]
            if any(e >= 0 for e in local):
                send_rank.append(r)
                send_token.append(t)
                send_ids.append(local)
                send_weights.append([weights[t][j] if local[j] >= 0 else 0.0 for j in range(len(local))])
    sent = set(zip(send_rank, send_token, strict=True))
    return dict(
        tokens_per_rank=[send_rank.count(r) for r in range(ep_size)],
        tokens_per_expert=[sum(row.count(e) for row in ids) for e in range(num_experts)],
        is_token_in_rank=[[(r, t) in sent for r in range(ep_size)] for t in range(len(ids))],
        send_token=send_token,
        send_ids=send_ids,
        send_weights=send_weights,
    )


def random_routes(rng: random.Random, t: int, k: int, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """t tokens of k distinct experts drawn from `experts`, weights in [0, 1)."""
    ids = torch.tensor([rng.sample(experts, k) for _ in range(t)], dtype=torch.int32).reshape(t, k)
    weights = torch.tensor([[rng.random() for _ in range(k)] for _ in range(t)], dtype=torch.float32).reshape(t, k)
    return ids, weights


@pytest.mark.parametrize(
    "t, k, num_experts, ep_size, seed",
    [(1, 1, 2, 2, 0), (7, 3, 8, 2, 1), (13, 4, 12, 3, 2), (29, 6, 16, 4, 3), (0, 3, 8, 4, 4), (33, 2, 32, 8, 5)],
)
def test_layout_matches_loops(t: int, k: int, num_experts: int, ep_size: int, seed: int) -> None:
    rng = random.Random(seed)
    per = num_experts // ep_size
    empty_rank = 1 if ep_size >= 3 else None  # no token has an expert there: it receives zero rows
    experts = [e for e in range(num_experts) if e // per != empty_rank]
    ids, weights = random_routes(rng, t, k, experts)
    if t >= 3 and k <= per:
        ids[0] = torch.arange(k)  # every expert of token 0 on rank 0
        ids[1] = num_experts - 1 - torch.arange(k)  # token 1 only on the last rank
    if t >= 3:
        ids[2, 0] = -1  # a pair with no expert goes nowhere
    got = dispatch_layout(ids, weights, num_experts, ep_size)
    want = layout_loops(ids.tolist(), weights.tolist(), num_experts, ep_size)
    if empty_rank is not None:
        assert want["tokens_per_rank"][empty_rank] == 0
    assert got.tokens_per_rank.tolist() == want["tokens_per_rank"]
    assert got.tokens_per_expert.tolist() == want["tokens_per_expert"]
    assert got.is_token_in_rank.tolist() == want["is_token_in_rank"]
    assert got.send_token.tolist() == want["send_token"]
    assert got.send_ids.dtype == torch.int32 and got.send_ids.reshape(-1, k).tolist() == want["send_ids"]
    assert got.send_weights.reshape(-1, k).tolist() == want["send_weights"]  # exact: copied, never computed


def test_local_experts_and_slice() -> None:
    assert [local_experts(12, r, 3) for r in range(3)] == [range(0, 4), range(4, 8), range(8, 12)]
    with pytest.raises(ValueError, match="not a multiple"):
        local_experts(10, 0, 4)
    w = torch.arange(12 * 2).reshape(12, 2)
    assert torch.equal(expert_slice(w, range(4, 8)), w[4:8])


# ---------------------------------------------------------------- the MoE layer


def batch(t: int) -> ForwardBatch:
    """A one-request extend of t tokens: the router reads only fb.replay."""
    return ForwardBatch.build(
        forward_id=0, input_ids=[0] * t, prefix_lens=[0], extend_lens=[t], req_pool_indices=[0],
        out_cache_loc=np.arange(t), req_to_token=torch.zeros(1, t + 1, dtype=torch.int32), logits_rows=[],
        device="cpu",
    )  # fmt: skip


def full_moe(backend: str = "ref", seed: int = 0) -> MoE:
    """The one-process MoE (all E experts, shared MLP unfused), weights seeded."""
    moe = MoE(CFG, 0, NullRecorder(), make_routing_ops("ref"), make_experts_fn(backend, CFG), torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    for _, p in sorted(moe.named_parameters()):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.15)
    assert moe.gate.e_score_correction_bias is not None
    moe.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.3)
    return moe


def test_null_dispatcher_is_todays_path() -> None:
    moe = full_moe()
    x = torch.randn(11, CFG.hidden_size, generator=torch.Generator().manual_seed(1))
    weights, ids = moe.gate(x, batch(11))
    assert isinstance(moe.dispatcher, NullDispatcher) and moe.dispatcher.experts == range(E)
    assert isinstance(make_dispatcher(E), NullDispatcher)
    want = fused_moe_ref(x, moe.w13, moe.w2, ids, weights) + moe.shared_experts(x)
    assert torch.equal(moe(x, batch(11)), want)


def test_fused_shared_refused_under_ep() -> None:
    class HalfTheExperts:  # a stand-in holding 4 of 8 experts: the check is made before any collective
        experts = range(4, 8)

    with pytest.raises(ValueError, match="fuse_shared_experts"):
        MoE(CFG, 0, NullRecorder(), make_routing_ops("ref"), make_experts_fn("ref"), torch.float32, "cpu",
            fuse_shared=True, dispatcher=HalfTheExperts())  # type: ignore[arg-type]  # fmt: skip


def rank_tokens(rank: int, counts: list[int]) -> torch.Tensor:
    return torch.randn(counts[rank], CFG.hidden_size, generator=torch.Generator().manual_seed(100 + rank))


def _worker(rank: int, world: int, port: int, counts: list[int], backends: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        full = full_moe()
        dispatcher = make_dispatcher(E, rank, world)
        assert isinstance(dispatcher, AllToAllDispatcher)

        # what reaches this rank: from each source rank in rank order, its rows for this rank, in token order
        routes = [full.gate(rank_tokens(r, counts), batch(counts[r])) for r in range(world)]
        want_ids: list[list[int]] = []
        want_weights: list[list[float]] = []
        want_rows: list[torch.Tensor] = []
        for r, (w, ids) in enumerate(routes):
            lay = layout_loops(ids.tolist(), w.tolist(), E, world)
            start = sum(lay["tokens_per_rank"][:rank])
            rows = range(start, start + lay["tokens_per_rank"][rank])
            want_ids += [lay["send_ids"][i] for i in rows]
            want_weights += [lay["send_weights"][i] for i in rows]
            want_rows += [rank_tokens(r, counts)[lay["send_token"][i]] for i in rows]
        x = rank_tokens(rank, counts)
        got = dispatcher.dispatch(x, routes[rank][1], routes[rank][0])
        assert got.topk_ids.tolist() == want_ids
        assert got.topk_weights.tolist() == want_weights
        assert torch.equal(got.hidden, torch.stack(want_rows) if want_rows else x.new_empty(0, CFG.hidden_size))

        for backend in backends:  # the experts functions the engine has: ref grouped compute, fused Triton MoE
            full = full_moe(backend)
            ep = MoE(CFG, 0, NullRecorder(), make_routing_ops("ref"), make_experts_fn(backend, CFG), torch.float32,
                     "cpu", dispatcher=dispatcher)  # fmt: skip
            state = full.state_dict()
            for name in ("w13", "w2"):
                state[name] = expert_slice(state[name], dispatcher.experts)
            ep.load_state_dict(state)
            out = ep(x, batch(x.shape[0]))
            ref = full(x, batch(x.shape[0]))
            assert out.shape == ref.shape == x.shape
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5, msg=lambda m, b=backend: f"{b}: {m}")
    finally:
        dist.destroy_process_group()



def run_ranks(counts: list[int], backends: tuple[str, ...]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2-4 processes on 2 cores: no thread oversubscription
    spawn_ranks(_worker, (len(counts), free_port(), counts, backends), len(counts))

# the ranks run on CPU: the fused Triton MoE only under the interpreter
BACKENDS = ("ref", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("ref",)


def test_ep2_matches_one_process() -> None:
    run_ranks([37, 0], BACKENDS)  # rank 1 has no tokens and still joins every collective


@pytest.mark.slow
def test_ep4_matches_one_process() -> None:
    run_ranks([19, 0, 5, 26], BACKENDS)


# ---------------------------------------------------------------- redundant experts, low-latency mode, rebalance
#
# E = 8 experts in P = 12 slots (P/G = 6 on ep2, 3 on ep4). Placement A is SGLang's trivial one (slot p holds
# expert p % 8), B a shuffle with other replicas. The one-process MoE is the reference for every mode and
# dispatch, to the tolerance above: normal mode adds a token's pairs per rank in slot order, then the ranks in
# rank order, where the one-process MoE adds them in expert order, and an expert's GEMM runs over other row
# counts (CPU BLAS gives rows of a 1- or 2-row GEMM other bits than the same rows inside a larger one).
# The low-latency combine adds the K pairs in k order whatever the placement, so with a batch-invariant experts
# function (rowwise_experts: every row alone, standing in for exact mode's batch-invariant matmuls) its output is
# bitwise the one-process k-order sum, for static and dynamic dispatch and across a rebalance.
SLOTS = 12


def placement_b(world: int) -> ExpertLocation:
    rng = random.Random(world)
    row = list(range(E)) + [rng.randrange(E) for _ in range(SLOTS - E)]
    rng.shuffle(row)
    return ExpertLocation.from_physical_to_logical([row], E, world, (0,))


def rowwise_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """fused_moe_ref's math with every (row, pair) computed alone (1-row GEMMs) and added in k order:
    a row's result does not depend on which other rows share its expert."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for r, k in (topk_ids >= 0).nonzero().tolist():
        e = int(topk_ids[r, k])
        gate, up = F.linear(x[r : r + 1], w13[e]).chunk(2, dim=-1)
        out[r] += F.linear(F.silu(gate) * up, w2[e])[0].float() * topk_weights[r, k]
    return out.to(x.dtype)


def k_order_ref(full: MoE, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """The one-process MoE, every pair alone, added in k order (the low-latency combine's order)."""
    weights, ids = full.gate(x, fb)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for k in range(ids.shape[1]):
        y = rowwise_experts(x, full.w13, full.w2, ids[:, k : k + 1], torch.ones(x.shape[0], 1))  # unweighted
        out += y.float() * weights[:, k, None]
    assert full.shared_experts is not None
    return out.to(x.dtype) + full.shared_experts(x)


def ep_moe(full: MoE, loc: ExpertLocation, rank: int, world: int, mode: str, dispatch: str, max_tokens: int,
           experts_fn: Any = fused_moe_ref) -> MoE:  # fmt: skip
    """This rank's MoE: its P/G slots' weights (physical_expert_weights), the map, the dispatcher of `mode`."""
    dispatcher = make_dispatcher(loc.num_physical, rank, world, mode=mode, max_tokens=max_tokens)  # type: ignore[arg-type]
    moe = MoE(CFG, 0, NullRecorder(), make_routing_ops("ref"), experts_fn, torch.float32, "cpu",
              dispatcher=dispatcher)  # fmt: skip
    state = full.state_dict()
    state["w13"], state["w2"] = physical_expert_weights(state["w13"], state["w2"], loc, 0, rank)
    moe.load_state_dict(state)
    apply_expert_location(nn.ModuleList([moe]), loc, rank, dispatch, seed=5)  # type: ignore[arg-type]
    return moe


def check_low_latency_layout(full: MoE, loc: ExpertLocation, rank: int, counts: list[int]) -> None:
    """recv_x [E_local, M * G, D] and recv_count against loops: slot j's rows from each source rank in rank order,
    each source's in token order, packed at the front; the rest zero, with id -1."""
    world, m = len(counts), max(counts)
    per = loc.slots_per_rank
    ll = make_dispatcher(loc.num_physical, rank, world, mode="low_latency", max_tokens=m)
    assert isinstance(ll, LowLatencyDispatcher)
    want: list[list[torch.Tensor]] = [[] for _ in range(per)]
    for src in range(world):
        xs = rank_tokens(src, counts)
        w, ids = full.gate(xs, batch(counts[src]))
        phys = ExpertMap(loc, 0, src, "static").to_physical(ids)  # what rank src sends
        for t in range(counts[src]):
            for slot in phys[t].tolist():
                if slot // per == rank:
                    want[slot - rank * per].append(xs[t])
        if src == rank:
            got = ll.dispatch(xs, phys, w)
    assert got.hidden.shape == (per * m * world, CFG.hidden_size)  # fixed: set by P, M, G and D, never by routes
    recv = got.hidden.view(per, m * world, CFG.hidden_size)
    assert got.handle.recv_count.tolist() == [len(rows) for rows in want]
    for j, rows in enumerate(want):
        if rows:
            assert torch.equal(recv[j, : len(rows)], torch.stack(rows))
        assert not recv[j, len(rows) :].any()
    ids = got.topk_ids.view(per, m * world)
    assert ids.tolist() == [[j] * len(rows) + [-1] * (m * world - len(rows)) for j, rows in enumerate(want)]
    ll.combine(got.hidden, got.handle)  # every dispatch has its combine: the peers wait for it


def _placement_worker(rank: int, world: int, port: int, counts: list[int], backends: tuple[str, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        full = full_moe()
        a = ExpertLocation.trivial(E, world, (0,), num_physical=SLOTS)
        b = placement_b(world)
        x, fb = rank_tokens(rank, counts), batch(counts[rank])
        ref, ref_k = full(x, fb), k_order_ref(full, x, fb)
        m = max(counts)
        check_low_latency_layout(full, b, rank, counts)

        outs = {}
        for mode in ("normal", "low_latency"):
            for dispatch in ("static", "dynamic"):
                out = ep_moe(full, b, rank, world, mode, dispatch, m)(x, fb)
                torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5, msg=lambda s, k=(mode, dispatch): f"{k} {s}")
                outs[mode, dispatch] = out
        for dispatch in ("static", "dynamic"):  # the two layouts: the same output up to the fp32 sum order
            torch.testing.assert_close(outs["low_latency", dispatch], outs["normal", dispatch], atol=1e-6, rtol=1e-5)
        for backend in backends[1:]:  # the fused Triton MoE over the low-latency rows (padding ids -1)
            out = ep_moe(full, b, rank, world, "low_latency", "dynamic", m, make_experts_fn(backend, CFG))(x, fb)
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
        for dispatch in ("static", "dynamic"):  # bitwise: the combine's order does not depend on the placement
            out = ep_moe(full, b, rank, world, "low_latency", dispatch, m, rowwise_experts)(x, fb)
            assert torch.equal(out, ref_k), dispatch

        # rebalance A -> B between two forwards: the weights move, the outputs stay
        for mode, fn in (("normal", fused_moe_ref), ("low_latency", rowwise_experts)):
            moe = ep_moe(full, a, rank, world, mode, "dynamic", m, fn)
            before = moe(x, fb)
            update_expert_placement(nn.ModuleList([moe]), b, lambda _: (full.w13.detach(), full.w2.detach()))
            held = b.physical_to_logical[0, b.rank_slots(rank).start : b.rank_slots(rank).stop]
            assert torch.equal(moe.w13, full.w13[held]) and torch.equal(moe.w2, full.w2[held])
            assert moe.expert_map is not None and moe.expert_map.location is b
            after = moe(x, fb)
            torch.testing.assert_close(after, ref, atol=1e-6, rtol=1e-5)
            if mode == "low_latency":
                assert torch.equal(before, ref_k) and torch.equal(after, ref_k)
    finally:
        dist.destroy_process_group()


def run_placement_ranks(counts: list[int], backends: tuple[str, ...]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn_ranks(_placement_worker, (len(counts), free_port(), counts, backends), len(counts))


def test_ep2_redundant_experts_low_latency_and_rebalance() -> None:
    run_placement_ranks([37, 0], BACKENDS)  # rank 1 has no tokens and still joins every collective


@pytest.mark.slow
def test_ep4_redundant_experts_low_latency_and_rebalance() -> None:
    run_placement_ranks([19, 0, 5, 26], BACKENDS)
