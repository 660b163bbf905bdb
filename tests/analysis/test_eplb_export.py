"""EPLB exports as their consumers read them: SGLang's --init-expert-location loader, DeepSeek's three tensors.

SGLang's rules are read from python/sglang/srt/eplb/expert_location.py at sgl-project/sglang commit
01fec5c2e61f9568c41a6e1d4fd5ac46c88504f1 (compute_initial_expert_location_metadata, init_by_mapping,
init_trivial, _compute_logical_to_all_physical_map, compute_logical_to_rank_dispatch_physical_map) and
ModelConfigForExpertLocation of python/sglang/srt/models/deepseek_v2.py at commit
00114aef19bbb7431b9cfc5a77dce64b9c53ed95 (num_layers = num_hidden_layers). DeepSeek's order is read from
eplb.py of deepseek-ai/EPLB at commit d52c72d5b2f2fb4c41afbf8eb21366820239913d (rebalance_experts).
Run: .venv/bin/pytest tests/analysis/test_eplb_export.py -q
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from r3trace.eplb import Cluster, global_policy, hierarchical, plan, to_sglang
from r3trace.eplb.placement import PlacementError, from_json, to_json


def sglang_load(path: Path, num_hidden_layers: int, num_experts: int, ep_size: int,
                num_redundant: int) -> list[list[list[int]]]:
    """What SGLang does with --init-expert-location PATH, as acceptance rules; returns its
    logical_to_all_physical_map [layers][E][replicas] or raises where SGLang raises (or goes silently wrong)."""
    text = str(path)
    doc: dict[str, Any]
    if text.endswith(".pt"):
        doc = torch.load(text, weights_only=True)
    elif text.endswith(".json"):
        doc = json.loads(Path(text).read_text())
    else:
        doc = json.loads(text)  # any other value is inline JSON
    if "physical_to_logical_map" not in doc:
        # a lone logical_count goes to init_by_eplb as tokens per expert, not as a placement
        raise AssertionError(f"no physical_to_logical_map: SGLang would read {list(doc)} otherwise")
    # init_by_mapping(server_args, model_config, **doc): physical_to_logical_map is its only keyword
    extra = sorted(set(doc) - {"physical_to_logical_map"})
    if extra:
        raise TypeError(f"init_by_mapping() got an unexpected keyword argument {extra[0]!r}")
    m = doc["physical_to_logical_map"]
    m = m if isinstance(m, torch.Tensor) else torch.tensor(m)
    num_physical = num_experts + num_redundant  # _init_common
    assert num_physical % ep_size == 0, "num_physical_experts % ep_size"
    assert not m.is_floating_point(), "ids are indices"
    # rows are indexed by real layer id (model layers read physical_to_logical_map[layer_id]) over the
    # model's num_layers = num_hidden_layers; columns are the num_physical slots the expert weights hold
    assert tuple(m.shape) == (num_hidden_layers, num_physical), f"shape {tuple(m.shape)}"
    # _compute_logical_to_all_physical_map appends slot p to list [layer][logical id]: an id >= E raises,
    # a negative one lands silently on another expert
    assert int(m.min()) >= 0 and int(m.max()) < num_experts, "logical ids in 0..E-1"
    l2p: list[list[list[int]]] = [[[] for _ in range(num_experts)] for _ in range(num_hidden_layers)]
    for layer in range(num_hidden_layers):
        for slot in range(num_physical):
            l2p[layer][int(m[layer, slot])].append(slot)
    # static dispatch picks among an expert's slots (_fair_choices divides by their count): none is an error
    assert all(slots for row in l2p for slots in row), "every logical expert needs a slot on every layer"
    return l2p


def trivial_row(num_physical: int, num_experts: int) -> np.ndarray:
    """One row of init_trivial: arange(num_physical) % num_logical_experts."""
    return np.arange(num_physical) % num_experts


@pytest.mark.parametrize("suffix", [".json", ".pt"])
@pytest.mark.parametrize("moe_layer_ids", [(3, 4, 5, 6, 7), (1, 3, 5, 7, 9)])  # first_k_dense 3; every other
def test_sglang_loader_accepts_our_file(tmp_path: Path, suffix: str, moe_layer_ids: tuple[int, ...]) -> None:
    rng = np.random.default_rng(11)
    num_hidden_layers, e, cl = 10, 32, Cluster(num_gpus=8, num_nodes=2, num_slots=40, num_groups=4)
    pl = plan(rng.pareto(1.1, (len(moe_layer_ids), e)) + 0.01, cl)
    assert (pl.logcnt > 1).any()  # replicas exist, so the slot order is not the trivial one
    path = tmp_path / f"loc{suffix}"
    to_sglang(pl, path, num_hidden_layers, moe_layer_ids)
    l2p = sglang_load(path, num_hidden_layers, e, ep_size=8, num_redundant=40 - e)
    for layer in range(num_hidden_layers):
        if layer in moe_layer_ids:
            i = moe_layer_ids.index(layer)  # the plan of MoE layer i lands on its real layer id
            want = [sorted(s for s in pl.log2phy[i, x] if s >= 0) for x in range(e)]
        else:
            row = trivial_row(40, e)
            want = [np.flatnonzero(row == x).tolist() for x in range(e)]
        assert l2p[layer] == want, layer


def test_sglang_loader_rules_reject_the_old_file_and_bad_names(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    pl = plan(rng.pareto(1.1, (3, 16)) + 0.01, Cluster(num_gpus=4, num_nodes=1, num_slots=20, num_groups=4))
    old = tmp_path / "old.json"  # the earlier export: an extra key, one row per MoE layer
    old.write_text(json.dumps({"physical_to_logical_map": pl.phy2log.tolist(), "logical_count": pl.logcnt.tolist()}))
    with pytest.raises(TypeError, match="logical_count"):
        sglang_load(old, 4, 16, 4, 4)
    old.write_text(json.dumps({"physical_to_logical_map": pl.phy2log.tolist()}))
    with pytest.raises(AssertionError, match=r"shape \(3, 20\)"):
        sglang_load(old, 4, 16, 4, 4)
    with pytest.raises(PlacementError, match=r"loc.txt must end in .json or .pt"):
        to_sglang(pl, tmp_path / "loc.txt", 4, (1, 2, 3))
    with pytest.raises(PlacementError, match="moe_layer_ids lists 2 layers, the placement has 3"):
        to_sglang(pl, tmp_path / "loc.json", 4, (1, 2))


def _node_replicas(w: np.ndarray, experts: list[int], num_slots: int) -> list[tuple[int, int]]:
    """(expert, replica rank) of one node's slots before packing: every expert once in `experts` order, then
    each extra slot to the highest load per replica (the first such expert on ties), numbered by its count."""
    reps = [(x, 0) for x in experts]
    cnt = dict.fromkeys(experts, 1)
    while len(reps) < num_slots:
        best = max(experts, key=lambda x: w[x] / cnt[x])  # max returns the first maximum
        reps.append((best, cnt[best]))
        cnt[best] += 1
    return reps


def _pack(weights: list[float], num_packs: int) -> list[tuple[int, int]]:
    """(pack, rank in pack) of each item: heaviest first into the lightest pack with room, lowest pack on
    ties; one item per pack puts item i in pack i. Equal weights keep the order torch's sort gives them,
    the reference's own call (its order among ties is torch's, not a rule that can be restated)."""
    cap = len(weights) // num_packs
    if cap == 1:
        return [(i, 0) for i in range(len(weights))]
    order = torch.tensor(weights, dtype=torch.float32).sort(descending=True).indices.tolist()
    load, fill, out = [0.0] * num_packs, [0] * num_packs, [(0, 0)] * len(weights)
    for i in order:
        k = min((j for j in range(num_packs) if fill[j] < cap), key=lambda j: load[j])
        out[i] = (k, fill[k])
        load[k] += weights[i]
        fill[k] += 1
    return out


def deepseek_loops(w: np.ndarray, cl: Cluster) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rebalance_experts' (phy2log [L, P], log2phy [L, E, R], logcnt [L, E]) one layer and one node at a time:
    groups onto nodes, replicas inside each node, replicas onto the node's GPUs, log2phy[l, e, rank] = slot."""
    n_layers, e = w.shape
    groups, nodes = (cl.num_groups, cl.num_nodes) if cl.num_groups % cl.num_nodes == 0 else (1, 1)
    gsize, spn, spg = e // groups, cl.num_slots // nodes, cl.slots_per_gpu
    phy2log = np.zeros((n_layers, cl.num_slots), dtype=np.int64)
    rank = np.zeros_like(phy2log)
    for li in range(n_layers):
        at = _pack([float(w[li, g * gsize:(g + 1) * gsize].sum()) for g in range(groups)], nodes)
        for node in range(nodes):
            mine = sorted((g for g in range(groups) if at[g][0] == node), key=lambda g: at[g][1])
            reps = _node_replicas(w[li], [g * gsize + j for g in mine for j in range(gsize)], spn)
            count = {x: sum(1 for y, _ in reps if y == x) for x, _ in reps}
            where = _pack([float(w[li, x]) / count[x] for x, _ in reps], cl.num_gpus // nodes)
            for (x, r), (gpu, pos) in zip(reps, where, strict=True):
                phy2log[li, node * spn + gpu * spg + pos], rank[li, node * spn + gpu * spg + pos] = x, r
    logcnt = np.stack([np.bincount(row, minlength=e) for row in phy2log])
    log2phy = np.full((n_layers, e, int(logcnt.max())), -1, dtype=np.int64)
    for li in range(n_layers):
        for slot in range(cl.num_slots):
            log2phy[li, phy2log[li, slot], rank[li, slot]] = slot
    return phy2log, log2phy, logcnt


@pytest.mark.parametrize("gpus,nodes,slots,groups,integer", [
    (8, 2, 40, 4, False), (8, 4, 48, 8, True), (4, 1, 24, 4, True), (6, 3, 36, 4, False), (2, 2, 36, 2, True),
])
def test_deepseek_export_orders_log2phy_by_replica_rank(gpus: int, nodes: int, slots: int, groups: int,
                                                         integer: bool) -> None:
    rng = np.random.default_rng(gpus * 100 + slots)
    e = 32 if slots >= 32 else 16
    w = rng.integers(1, 60, (4, e)).astype(float) if integer else rng.pareto(1.2, (4, e)) + 0.01  # ties / none
    cl = Cluster(gpus, nodes, slots, num_groups=groups)
    pl = hierarchical(w, cl) if groups % nodes == 0 else global_policy(w, cl)
    phy2log, log2phy, logcnt = deepseek_loops(w, cl)
    assert (logcnt > 1).sum() >= 4  # replicas whose order is being checked
    np.testing.assert_array_equal(pl.phy2log, phy2log)
    np.testing.assert_array_equal(pl.logcnt, logcnt)
    np.testing.assert_array_equal(pl.log2phy, log2phy)
    back, _ = from_json(to_json(pl, cl))  # the file keeps that order
    np.testing.assert_array_equal(back.log2phy, log2phy)


def test_from_phy2log_names_the_first_bad_row() -> None:
    """A map with an id outside 0..E-1, or an expert no slot holds, is refused naming the row and the fault (the shared
    row check, r3trace/phy2log.py)."""
    from r3trace.eplb.placement import from_phy2log

    ok = np.tile(np.arange(6) % 4, (2, 1))  # [2 layers, 6 slots] over 4 experts
    assert from_phy2log(ok, 4).logcnt.tolist() == [[2, 2, 1, 1]] * 2
    bad = ok.copy()
    bad[1, 3] = 4
    with pytest.raises(PlacementError, match=r"^phy2log row 1: slot 3 holds expert 4, outside 0\.\.3$"):
        from_phy2log(bad, 4)
    gap = ok.copy()
    gap[0] = [0, 1, 2, 0, 1, 2]
    with pytest.raises(PlacementError, match=r"^phy2log row 0: expert 3 of 0\.\.3 has no slot$"):
        from_phy2log(gap, 4)
