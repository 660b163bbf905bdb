"""Expert placement on the MoE layer and on a whole model, in one process: redundant slots, capture, rebalance.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_expert_placement.py

The maps themselves (sources, refusals, static / dynamic choice) are tested in test_expert_location.py, the same
under ep2 / ep4 gloo ranks in test_expert_parallel.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from bench.tiny_models import direct_forward, load_engine_model, make_checkpoint
from r3trace.capture.recorder import NullRecorder
from r3trace.engine.expert_placement import apply_expert_location, moe_layers, update_chunks
from r3trace.engine.layers.dispatcher import NullDispatcher
from r3trace.engine.layers.expert_location import ExpertLocation, ExpertLocationError, physical_expert_weights
from r3trace.engine.layers.expert_map import ExpertMap
from r3trace.engine.layers.moe import MoE, make_experts_fn
from r3trace.engine.layers.router import make_routing_ops
from tests.engine.test_expert_location import LAYERS, PHY2LOG
from tests.engine.test_expert_parallel import CFG, E, batch, full_moe


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

    def capture(self, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                row0: int = 0) -> None:
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
