"""ExpertLocation, the logical -> physical map (static / dynamic), and rebalance, in one process.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_expert_location.py

Contracts encoded here, read from (not copied):
- SGLang's init-expert-location JSON and its loader (compute_initial_expert_location_metadata, init_by_mapping,
  _compute_logical_to_all_physical_map: replicas in ascending slot order) and static dispatch
  (compute_logical_to_rank_dispatch_physical_map: a same-rank replica first): python/sglang/srt/eplb/
  expert_location.py at sgl-project/sglang@01fec5c2e61f9568c41a6e1d4fd5ac46c88504f1; dynamic dispatch:
  expert_location_dispatch.py at sgl-project/sglang@032b6b863ff968c3c5620afd12e774a24766364e.
- DeepSeek EPLB's three tensors (phy2log [L, P], log2phy [L, E, R] by replica rank, -1 padded, logcnt [L, E]):
  eplb.py at deepseek-ai/EPLB@d52c72d5b2f2fb4c41afbf8eb21366820239913d.
The MoE layer and a whole model under a placement (and rebalance) are in test_expert_placement.py; the
multi-process half (normal and low-latency modes, redundant experts, rebalance) in test_expert_parallel.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from r3trace.engine.layers.dispatcher import dispatch_layout
from r3trace.engine.layers.expert_location import (
    ExpertLocation,
    ExpertLocationError,
    held_experts,
    physical_expert_weights,
)
from r3trace.engine.layers.expert_map import ExpertMap, static_choice
from r3trace.engine.model_config import ModelConfig
from r3trace.eplb.placement import Cluster, from_phy2log, to_json
from tests.engine.test_expert_parallel import CFG, E, K, layout_loops

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
        (dict(phy=lambda p: p.__setitem__((0, 3), 8)),
         r"^physical_to_logical row 0 \(layer 1\): slot 3 holds expert 8, outside 0\.\.7$"),
        (dict(phy=lambda p: p.__setitem__((1, 0), -1)),
         r"^physical_to_logical row 1 \(layer 2\): slot 0 holds expert -1, outside 0\.\.7$"),
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
    with pytest.raises(ExpertLocationError, match=r"^physical_to_logical row 0 \(layer 1\): expert 7 of 0\.\.7 has no "
                       r"slot$"):
        ExpertLocation.from_physical_to_logical(no_replica, E, 2, LAYERS)
    with pytest.raises(ExpertLocationError, match="P=12 slots, not a multiple of ep_size=5"):
        ExpertLocation.from_physical_to_logical(PHY2LOG, E, 5, LAYERS)
    with pytest.raises(ExpertLocationError, match="P=6 slots, fewer than E=8"):
        ExpertLocation.trivial(E, 2, LAYERS, num_physical=6)
    with pytest.raises(ExpertLocationError, match=r"^physical_to_logical row 0 \(layer 1\): slot 0 holds expert 8, "
                       r"outside 0\.\.7$"):
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
