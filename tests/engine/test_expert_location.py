"""ExpertLocation, the logical -> physical map (static / dynamic), and rebalance, in one process.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/engine/test_expert_location.py

Contracts encoded here, read from (not copied):
- SGLang's init-expert-location JSON and its loader (compute_initial_expert_location_metadata, init_by_mapping,
  _compute_logical_to_all_physical_map: replicas in ascending slot order) and static dispatch
  (compute_logical_to_rank_dispatch_physical_map: a same-rank replica first): python/sglang/srt/eplb/
  expert_location.py at sgl-project/sglang@01fec5c2e61f9568c41a6e1d4fd5ac46c88504f1; dynamic dispatch:
  expert_location_dispatch.py at sgl-project/sglang@032b6b863ff968c3c5620afd12e774a24766364e.
- DeepSeek EPLB's three tensors (phy2log [L, P], log2phy [L, E, R] by replica rank, -1 padded, logcnt [L, E]):
  eplb.py at deepseek-ai/EPLB@d52c72d5b2f2fb4c41afbf8eb21366820239913d.
The multi-process half (normal and low-latency modes, redundant experts, rebalance) is in test_expert_parallel.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from r3trace.capture.recorder import NullRecorder
from r3trace.engine.config import ModelConfig
from r3trace.engine.expert_placement import apply_expert_location, moe_layers, update_chunks
from r3trace.engine.layers.dispatcher import NullDispatcher, dispatch_layout
from r3trace.engine.layers.expert_location import (
    ExpertLocation,
    ExpertLocationError,
    held_experts,
    physical_expert_weights,
)
from r3trace.engine.layers.expert_map import ExpertMap, static_choice
from r3trace.engine.layers.moe import MoE, make_experts_fn
from r3trace.engine.layers.router import make_routing_ops
from r3trace.eplb.placement import Cluster, from_phy2log, to_json
from tests.engine.test_expert_parallel import CFG, E, K, batch, full_moe, layout_loops
from tests.tiny_models import direct_forward, load_engine_model, make_checkpoint

# Two MoE layers (ids 1 and 2; layer 0 is dense), E = 8 logical experts in P = 12 slots on G = 2 ranks.
PHY2LOG = [
    [0, 1, 2, 3, 0, 4, 5, 6, 7, 0, 3, 6],  # expert 0 three times (slots 0, 4, 9), 3 and 6 twice
    [7, 6, 5, 4, 3, 2, 1, 0, 1, 1, 2, 7],
]
LOG2PHY = [  # by ascending slot: SGLang's and r3trace's order
    [[0, 4, 9], [1, -1, -1], [2, -1, -1], [3, 10, -1], [5, -1, -1], [6, -1, -1], [7, 11, -1], [8, -1, -1]],
    [[7, -1, -1], [6, 8, 9], [5, 10, -1], [4, -1, -1], [3, -1, -1], [2, -1, -1], [1, -1, -1], [0, 11, -1]],
]
LOGCNT = [[3, 1, 1, 2, 1, 1, 2, 1], [1, 3, 2, 1, 1, 1, 1, 2]]
LAYERS = (1, 2)
CFG3 = ModelConfig.from_dict({**CFG.to_dict(), "num_hidden_layers": 3, "first_k_dense_replace": 1})


def hand_built() -> ExpertLocation:
    return ExpertLocation(torch.tensor(PHY2LOG), torch.tensor(LOG2PHY), torch.tensor(LOGCNT), 2, LAYERS)


# ---------------------------------------------------------------- sources


def test_sources_load_into_the_hand_built_map(tmp_path: Path) -> None:
    want = hand_built()
    assert want.num_physical == 12 and want.num_logical == E and want.slots_per_rank == 6
    assert ExpertLocation.from_physical_to_logical(PHY2LOG, E, 2, LAYERS).same_as(want)
    placement = from_phy2log(np.array(PHY2LOG), E)  # r3trace's EPLB contract
    assert ExpertLocation.from_placement(placement, 2, LAYERS).same_as(want)
    text = to_json(placement, Cluster(num_gpus=2, num_nodes=1, num_slots=12, num_groups=4), {"policy": "global"})
    assert ExpertLocation.from_eplb_json(text, LAYERS).same_as(want)  # what `r3trace eplb --out` writes
    # SGLang: one row per hidden layer; the dense layer 0 holds the trivial map (slot p: expert p % E)
    doc = {"physical_to_logical_map": [[p % E for p in range(12)], *PHY2LOG]}
    (tmp_path / "loc.json").write_text(json.dumps(doc))
    assert ExpertLocation.from_sglang(tmp_path / "loc.json", CFG3, 2).same_as(want)
    assert ExpertLocation.from_sglang(json.dumps(doc), CFG3, 2).same_as(want)
    assert ExpertLocation.from_sglang(doc, CFG3, 2).layer_ids == (1, 2)


def test_trivial_and_deepseek_replica_order() -> None:
    t = ExpertLocation.trivial(E, 2, LAYERS)
    assert t.physical_to_logical.tolist() == [list(range(E))] * 2 and t.is_identity(1)
    t12 = ExpertLocation.trivial(E, 4, LAYERS, num_physical=12)  # SGLang's init_trivial: p % E
    assert t12.physical_to_logical[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3] and not t12.is_identity(1)
    assert t12.logical_to_physical[0, :4].tolist() == [[0, 8], [1, 9], [2, 10], [3, 11]]
    # DeepSeek's rebalance_experts lists replicas by replica rank, not by slot: the given order is kept
    l2p = torch.tensor(LOG2PHY)
    l2p[0, 0] = torch.tensor([9, 0, 4])
    loc = ExpertLocation(torch.tensor(PHY2LOG), l2p, torch.tensor(LOGCNT), 2, LAYERS)
    assert loc.logical_to_physical[0, 0].tolist() == [9, 0, 4]
    assert static_choice(loc, 1, 0)[0] == 0  # still a same-rank replica: slot 0 (rank 0 holds slots 0..5)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(phy=lambda p: p.__setitem__((0, 9), 1)), "logical_count"),  # expert 0 loses a slot, count says 3
        (dict(phy=lambda p: p.__setitem__((0, 3), 8)), r"physical_to_logical\[0, 3\] = 8; ids must lie in 0..7"),
        (dict(phy=lambda p: p.__setitem__((1, 0), -1)), r"physical_to_logical\[1, 0\] = -1"),
        (dict(l2p=lambda q: q.__setitem__((0, 0, 2), 12)), r"logical_to_physical has R=3 columns and ids -1..12"),
        (dict(l2p=lambda q: q.__setitem__((0, 1, 0), 2)), "logical_to_physical row 0"),  # slot 2 holds expert 2
        (dict(l2p=lambda q: q.__setitem__((1, 0, 1), 7)), "logical_to_physical row 1"),  # a padding entry set
    ],
)
def test_bad_maps_are_refused(change: dict, match: str) -> None:
    phy, l2p, cnt = torch.tensor(PHY2LOG), torch.tensor(LOG2PHY), torch.tensor(LOGCNT)
    change.get("phy", lambda p: None)(phy)
    change.get("l2p", lambda q: None)(l2p)
    with pytest.raises(ExpertLocationError, match=match):
        ExpertLocation(phy, l2p, cnt, 2, LAYERS)


def test_bad_sources_are_refused() -> None:
    no_replica = [[0, 1, 2, 3, 0, 4, 5, 6, 0, 0, 3, 6], PHY2LOG[1]]  # expert 7 of layer 1 has no slot
    with pytest.raises(ExpertLocationError, match="logical expert 7 of layer 1 has no replica"):
        ExpertLocation.from_physical_to_logical(no_replica, E, 2, LAYERS)
    with pytest.raises(ExpertLocationError, match="P=12 slots, not a multiple of ep_size=5"):
        ExpertLocation.from_physical_to_logical(PHY2LOG, E, 5, LAYERS)
    with pytest.raises(ExpertLocationError, match="P=6 slots, fewer than E=8"):
        ExpertLocation.trivial(E, 2, LAYERS, num_physical=6)
    with pytest.raises(ExpertLocationError, match="holds id 8; ids must lie in 0..7"):
        ExpertLocation.from_physical_to_logical([[8] * 12, PHY2LOG[1]], E, 2, LAYERS)
    with pytest.raises(ExpertLocationError, match=r"SGLang indexes rows by layer id: expected \[num_hidden_layers=3"):
        ExpertLocation.from_sglang({"physical_to_logical_map": PHY2LOG}, CFG3, 2)  # MoE rows only: ambiguous
    with pytest.raises(ExpertLocationError, match="only physical_to_logical_map is read"):
        ExpertLocation.from_sglang({"logical_count": LOGCNT}, CFG3, 2)
    with pytest.raises(ExpertLocationError, match="layer_ids has 1 entries"):
        ExpertLocation(torch.tensor(PHY2LOG), torch.tensor(LOG2PHY), torch.tensor(LOGCNT), 2, (1,))
    with pytest.raises(ExpertLocationError, match="dispatch mode='random'"):
        ExpertMap(hand_built(), 1, 0, "random")  # type: ignore[arg-type]


def test_a_ranks_weights_are_its_slots_experts() -> None:
    loc = hand_built()
    assert held_experts(loc, 1, 0) == [0, 1, 2, 3, 0, 4] and held_experts(loc, 2, 1) == [1, 0, 1, 1, 2, 7]
    g = torch.Generator().manual_seed(9)
    w13, w2 = torch.randn(E, 6, 4, generator=g), torch.randn(E, 4, 3, generator=g)
    for rank in (0, 1):
        a, b = physical_expert_weights(w13, w2, loc, 2, rank)
        assert a.shape == (6, 6, 4) and b.shape == (6, 4, 3)
        for i, e in enumerate(held_experts(loc, 2, rank)):
            assert torch.equal(a[i], w13[e]) and torch.equal(b[i], w2[e])
    with pytest.raises(ExpertLocationError, match="full_w13 has 7 experts"):
        physical_expert_weights(w13[:7], w2, loc, 1, 0)
    with pytest.raises(ExpertLocationError, match="layer_id=0 is not a MoE layer"):
        held_experts(loc, 0, 0)


# ---------------------------------------------------------------- static and dynamic dispatch


def static_loops(loc: ExpertLocation, layer_id: int) -> list[list[int]]:
    """[G][E] by SGLang's rule: the first same-rank replica in logical_to_physical order, else a replica;
    the i-th rank (in rank order) with none takes replica (i + e) % count, spreading them over the replicas."""
    row, per = loc.row(layer_id), loc.slots_per_rank
    out = []
    for g in range(loc.ep_size):
        picks = []
        for e in range(loc.num_logical):
            reps = [s for s in loc.logical_to_physical[row, e].tolist() if s >= 0]
            local = [s for s in reps if s // per == g]
            lacking = [h for h in range(loc.ep_size) if not any(s // per == h for s in reps)]
            picks.append(local[0] if local else reps[(lacking.index(g) + e) % len(reps)])
        out.append(picks)
    return out


@pytest.mark.parametrize("ep_size, seed", [(2, 0), (4, 1), (6, 2)])
def test_static_choice_matches_loops(ep_size: int, seed: int) -> None:
    rng = random.Random(seed)
    phy = [list(range(E)) + [rng.randrange(E) for _ in range(4)] for _ in LAYERS]
    for row in phy:
        rng.shuffle(row)
    loc = ExpertLocation.from_physical_to_logical(phy, E, ep_size, LAYERS)
    for layer_id in LAYERS:
        want = static_loops(loc, layer_id)
        for g in range(ep_size):
            got = static_choice(loc, layer_id, g).tolist()
            assert got == want[g]
            assert [int(loc.physical_to_logical[loc.row(layer_id), s]) for s in got] == list(range(E))


def test_dynamic_choice_is_valid_seeded_and_spread() -> None:
    loc = hand_built()
    rng = random.Random(3)
    ids = torch.tensor([rng.sample(range(E), K) for _ in range(3000)], dtype=torch.int32)  # [T, K]
    ids[5, 1] = -1
    m = ExpertMap(loc, 1, 0, "dynamic", seed=11)
    phys = m.to_physical(ids)
    assert phys.dtype == torch.int32 and phys[5, 1] == -1
    valid = ids >= 0
    assert torch.equal(loc.physical_to_logical[0][phys[valid].long()], ids[valid].long())  # a replica of its expert
    # the same on every rank and every build: a function of (seed, layer, row, expert) only
    assert torch.equal(phys, ExpertMap(loc, 1, 1, "dynamic", seed=11).to_physical(ids))
    assert not torch.equal(phys, ExpertMap(loc, 1, 0, "dynamic", seed=12).to_physical(ids))
    assert not torch.equal(phys, ExpertMap(loc, 2, 0, "dynamic", seed=11).to_physical(ids))
    # spread: expert 0's three replicas each take a third of its ~1100 pairs (binomial sd ~16; 60 is ~4 sd)
    zero = phys[ids == 0]
    shares = [int((zero == s).sum()) for s in (0, 4, 9)]
    assert all(abs(n - len(zero) / 3) < 60 for n in shares), shares
    static = ExpertMap(loc, 1, 1, "static").to_physical(ids)
    assert set(static[ids == 0].tolist()) == {9}  # rank 1 (slots 6..11): its own replica, always


# ---------------------------------------------------------------- the layout over physical slots


@pytest.mark.parametrize("ep_size, mode", [(2, "static"), (2, "dynamic"), (4, "dynamic"), (6, "static")])
def test_layout_over_physical_slots_matches_loops(ep_size: int, mode: str) -> None:
    rng = random.Random(ep_size)
    loc = ExpertLocation.from_physical_to_logical(hand_built().physical_to_logical, E, ep_size, LAYERS)
    ids = torch.tensor([rng.sample(range(E), K) for _ in range(41)], dtype=torch.int32)
    weights = torch.rand(41, K, generator=torch.Generator().manual_seed(ep_size))
    ids[2, 0] = -1
    phys = ExpertMap(loc, 2, ep_size - 1, mode, seed=5).to_physical(ids)  # type: ignore[arg-type]
    got = dispatch_layout(phys, weights, loc.num_physical, ep_size)
    want = layout_loops(phys.tolist(), weights.tolist(), loc.num_physical, ep_size)
    assert got.tokens_per_rank.tolist() == want["tokens_per_rank"]
    assert got.tokens_per_expert.tolist() == want["tokens_per_expert"]
    assert got.send_token.tolist() == want["send_token"]
    assert got.send_ids.tolist() == want["send_ids"] and got.send_weights.tolist() == want["send_weights"]


# ---------------------------------------------------------------- the MoE layer in one process


def redundant_moe(full: MoE, loc: ExpertLocation, layer_id: int, mode: str) -> MoE:
    """One process holding all P slots (NullDispatcher over P): slot p carries expert phy2log[p]'s weights."""
    moe = MoE(CFG, layer_id, NullRecorder(), make_routing_ops("ref"), make_experts_fn("ref"), torch.float32, "cpu",
              dispatcher=NullDispatcher(loc.num_physical))  # fmt: skip
    state = full.state_dict()
    state["w13"], state["w2"] = physical_expert_weights(state["w13"], state["w2"], loc, layer_id, 0)
    moe.load_state_dict(state)
    moe.expert_map = ExpertMap(loc, layer_id, 0, mode)  # type: ignore[arg-type]
    return moe


class Recorder(NullRecorder):
    def __init__(self) -> None:
        self.seen: list[tuple[int, torch.Tensor]] = []

    def capture(self, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None) -> None:
        self.seen.append((layer_id, topk_ids.clone()))


# fp32: the one-process MoE adds a token's K weighted pairs in ascending expert order, the redundant one in
# ascending slot order, which the placement permutes: the same K = 3 products (|y| <= ~0.3) in another order,
# a few ulps (eps 1.2e-7); a pair sent to a slot holding another expert is off by O(0.1).
ATOL, RTOL = 1e-6, 1e-5


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_redundant_moe_matches_and_capture_stays_logical(mode: str) -> None:
    loc = ExpertLocation.from_physical_to_logical(PHY2LOG, E, 1, LAYERS)
    full = full_moe(seed=4)
    moe = redundant_moe(full, loc, 1, mode)
    logical, physical = Recorder(), Recorder()
    moe.gate.recorder = logical
    moe.physical_recorder = physical
    x = torch.randn(29, CFG.hidden_size, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(moe(x, batch(29)), full(x, batch(29)), atol=ATOL, rtol=RTOL)
    _, want_ids = full.gate(x, batch(29))
    assert len(logical.seen) == 1 and torch.equal(logical.seen[0][1], want_ids)  # capture: logical ids
    ((layer, phys),) = physical.seen
    assert layer == 1 and torch.equal(loc.physical_to_logical[0][phys.long()], want_ids.long())
    assert bool((phys >= E).any())  # some pairs really went to a redundant slot


def test_rebalance_moves_weights_and_keeps_outputs() -> None:
    """Two MoE layers as a model; a rebalance between two forwards, in chunks of one layer."""
    a = ExpertLocation.trivial(E, 1, LAYERS, num_physical=12)
    b = ExpertLocation.from_physical_to_logical(PHY2LOG, E, 1, LAYERS)
    fulls = {1: full_moe(seed=1), 2: full_moe(seed=2)}
    model = nn.ModuleList(redundant_moe(fulls[i], a, i, "dynamic") for i in LAYERS)
    apply_expert_location(model, a, 0, "dynamic", seed=3)
    x = torch.randn(23, CFG.hidden_size, generator=torch.Generator().manual_seed(8))
    before = [moe(x, batch(23)) for moe in model]
    source = {i: (fulls[i].w13.detach(), fulls[i].w2.detach()) for i in LAYERS}
    chunks = list(update_chunks(model, b, source.__getitem__, chunk_layers=1))
    assert [c.layer_ids for c in chunks] == [(1,), (2,)]
    moved = [sum(int(a.physical_to_logical[r, s] != b.physical_to_logical[r, s]) for s in range(12)) for r in (0, 1)]
    assert [c.slots_copied for c in chunks] == moved
    for moe, lid in zip(model, LAYERS, strict=True):
        assert moe.expert_map is not None and moe.expert_map.location is b and moe.expert_map.mode == "dynamic"
        assert torch.equal(moe.w13, fulls[lid].w13[b.physical_to_logical[b.row(lid)]])  # the weights moved
        assert torch.equal(moe.w2, fulls[lid].w2[b.physical_to_logical[b.row(lid)]])
    after = [moe(x, batch(23)) for moe in model]
    for one, two, lid in zip(before, after, LAYERS, strict=True):
        torch.testing.assert_close(two, one, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(two, fulls[lid](x, batch(23)), atol=ATOL, rtol=RTOL)


def test_refused_rebalance_changes_nothing() -> None:
    a = ExpertLocation.trivial(E, 1, LAYERS, num_physical=12)
    b = ExpertLocation.from_physical_to_logical(PHY2LOG, E, 1, LAYERS)
    full = full_moe(seed=1)
    moe = redundant_moe(full, a, 1, "static")
    assert moe.expert_map is not None
    w13, static = moe.w13.clone(), moe.expert_map.static.clone()
    w13_full, w2_full = full.w13.detach(), full.w2.detach()
    with pytest.raises(ExpertLocationError, match="new placement has E=8, P=16, ep_size=1; layer 1 was built for"):
        moe.update_expert_placement(ExpertLocation.trivial(E, 1, LAYERS, num_physical=16), w13_full, w2_full)
    with pytest.raises(ExpertLocationError, match=r"full_w13 \(8, 48, 47\), full_w2 \(8, 48, 24\): layer 1 needs"):
        moe.update_expert_placement(b, w13_full[:, :, :47], w2_full)
    with pytest.raises(ExpertLocationError, match="layer_id=1 is not a MoE layer"):
        moe.update_expert_placement(ExpertLocation.trivial(E, 1, (2,), num_physical=12), w13_full, w2_full)
    assert moe.expert_map.location is a and torch.equal(moe.expert_map.static, static) and torch.equal(moe.w13, w13)
    bare = MoE(CFG, 1, NullRecorder(), make_routing_ops("ref"), make_experts_fn("ref"), torch.float32, "cpu")
    with pytest.raises(ExpertLocationError, match="layer 1 has no expert map"):
        bare.update_expert_placement(b, w13_full, w2_full)


def test_map_tensors_keep_their_storage() -> None:
    """A CUDA graph captured before a rebalance reads the map's tensors at their addresses: load_ writes them in
    place, and their shapes ([E, P - E + 1], [E], [E]) do not depend on the placement."""
    a = ExpertLocation.trivial(E, 2, LAYERS, num_physical=12)
    b = ExpertLocation.from_physical_to_logical(PHY2LOG, E, 2, LAYERS)
    m = ExpertMap(a, 1, 1, "dynamic", seed=4)
    ptrs = [t.data_ptr() for t in (m.log2phy, m.count, m.static)]
    assert m.log2phy.shape == (E, 12 - E + 1)
    m.load_(b)
    assert [t.data_ptr() for t in (m.log2phy, m.count, m.static)] == ptrs and m.location is b
    fresh = ExpertMap(b, 1, 1, "dynamic", seed=4)
    for got, want in ((m.log2phy, fresh.log2phy), (m.count, fresh.count), (m.static, fresh.static)):
        assert torch.equal(got, want)
    assert m.log2phy[0].tolist() == [0, 4, 9, -1, -1]  # expert 0's three replicas, padded to P - E + 1


def test_map_switches_only_after_the_copy() -> None:
    """While the new slots' weights are read and copied, the layer still holds its old map: a forward that
    could run then would see old weights under the old map (the switch is the last step)."""
    a = ExpertLocation.trivial(E, 1, LAYERS, num_physical=12)
    b = ExpertLocation.from_physical_to_logical(PHY2LOG, E, 1, LAYERS)
    full = full_moe(seed=1)
    moe = redundant_moe(full, a, 1, "static")
    assert moe.expert_map is not None
    m, old_static = moe.expert_map, moe.expert_map.static.clone()
    seen: list[tuple[ExpertLocation, bool]] = []

    class Watched(torch.Tensor):  # full weights that note the layer's map whenever they are read
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.Tensor.index_select:
                seen.append((m.location, torch.equal(m.static.as_subclass(torch.Tensor), old_static)))
            return super().__torch_function__(func, types, args, kwargs or {})

    w13, w2 = full.w13.detach().as_subclass(Watched), full.w2.detach().as_subclass(Watched)
    assert moe.update_expert_placement(b, w13, w2) > 0
    assert seen and all(loc is a and unchanged for loc, unchanged in seen)
    assert m.location is b and not torch.equal(m.static, old_static)


# ---------------------------------------------------------------- a whole model


def test_model_rebalance_from_sglang_json_mid_run(tmp_path: Path) -> None:
    """The tiny V3 stack (layers 0-1 dense, 2-3 MoE): a placement read from SGLang's JSON is swapped in chunk by
    chunk, with a forward between the chunks. Every forward gives the same routes, exactly, and the same logits
    (fp32: each token's pairs are added in slot order, which the placement permutes; 1e-5 as in the TP tests)."""
    model_dir = make_checkpoint(tmp_path / "m", "v3_dense2_yarn")
    model = load_engine_model(model_dir)
    cfg = model.config
    moes = moe_layers(model)
    source = {m.gate.layer_id: (m.w13.detach().clone(), m.w2.detach().clone()) for m in moes}
    tokens = [random.Random(0).randrange(cfg.vocab_size) for _ in range(19)]
    logits0, routes0 = direct_forward(model, tokens)

    apply_expert_location(model, ExpertLocation.trivial(E, 1, cfg.moe_layer_ids), 0, "static")
    perm = [list(reversed(range(E))), [3, 1, 4, 0, 5, 7, 2, 6]]  # P = E: the rows the model was built with
    doc = {"physical_to_logical_map": [list(range(E)), list(range(E)), *perm]}  # dense rows: trivial
    new = ExpertLocation.from_sglang(json.dumps(doc), cfg, 1)
    chunks = update_chunks(model, new, source.__getitem__, chunk_layers=1)
    assert next(chunks).layer_ids == (2,)
    mid = direct_forward(model, tokens)  # layer 2 moved, layer 3 not yet
    assert [c.layer_ids for c in chunks] == [(3,)]
    logits1, routes1 = direct_forward(model, tokens)
    for logits, routes in (mid, (logits1, routes1)):
        assert routes.keys() == routes0.keys() and all(torch.equal(routes[i], routes0[i]) for i in routes0)
        torch.testing.assert_close(logits, logits0, atol=1e-5, rtol=0)
    for moe, row in zip(moes, perm, strict=True):
        assert torch.equal(moe.w13, source[moe.gate.layer_id][0][row])  # slot p holds expert perm[p]
