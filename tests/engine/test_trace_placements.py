"""The placements table of an engine trace: the map in force when the trace starts and each rebalance chunk's new
rows, with the forward they apply from, so that every route row's physical_ids name slots that hold its topk_ids
under the map of its own forward (0 mismatches), one process and two (expert parallelism over gloo ranks).

    TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_trace_placements.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from r3trace.analysis.store import TraceStore
from r3trace.engine import Engine
from r3trace.engine.model_config import ModelConfig
from r3trace.trace import open_dataset
from r3trace.trace.placements import placement_at, read_placements

MODEL = Path(__file__).resolve().parents[2] / "samples" / "model"
E, REDUNDANT = 32, 8  # the sample model's routed experts; P = 40 slots
GREEDY = {"max_new_tokens": 5, "temperature": 0.0}


def shuffled(seed: int, num_hidden_layers: int) -> np.ndarray:
    """[num_hidden_layers, P]: each row a shuffle of the E experts, then REDUNDANT seeded replicas."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.cat([torch.randperm(E, generator=g), torch.randint(0, E, (REDUNDANT,), generator=g)])
                        for _ in range(num_hidden_layers)]).numpy()


def write(path: Path, phy2log: np.ndarray) -> str:
    path.write_text(json.dumps({"physical_to_logical_map": phy2log.tolist()}))
    return str(path)


@pytest.mark.parametrize("parallel", [{}, {"tp_size": 2, "ep_size": 2}], ids=["one-process", "ep2"])
def test_rows_name_slots_of_the_map_their_forward_ran(tmp_path: Path, parallel: dict[str, int]) -> None:
    mc = ModelConfig.from_hf(MODEL)
    moe = list(mc.moe_layer_ids)
    first, second = shuffled(11, mc.num_hidden_layers), shuffled(12, mc.num_hidden_layers)
    store = tmp_path / "store"
    with Engine(MODEL, ep_num_redundant_experts=REDUNDANT, init_expert_location=write(tmp_path / "a.json", first),
                ep_dispatch_algorithm="dynamic", capture_physical_ids=True, page_size=4, **parallel) as engine:
        engine.start_trace(store, run_id="moves")
        engine.generate(input_ids=[5, 9, 14, 3, 8, 1], sampling_params=GREEDY, rid="before")
        done = engine.update_expert_placement(write(tmp_path / "b.json", second), chunk_layers=1)
        engine.generate(input_ids=[6, 2, 11, 4], sampling_params=GREEDY, rid="after")
        engine.stop_trace()
    assert done["chunks"] == len(moe)

    run = open_dataset(store)[0]
    assert len(run.manifest.placements) == 1 + len(moe)  # the trace start's, then one a chunk
    table = read_placements(run)
    starts = sorted(set(table.column("from_forward_id").to_pylist()))
    routes = TraceStore(store).query(
        "SELECT request_id, forward_id, layer_id, topk_ids, physical_ids FROM routes ORDER BY forward_id, layer_id")
    fwd = routes["forward_id"].to_numpy()
    layer = routes["layer_id"].to_numpy()
    topk = np.array(routes["topk_ids"].to_list())
    phys = np.array(routes["physical_ids"].to_list())
    before = routes["request_id"].to_numpy() == "before"
    assert fwd[before].max() < starts[1] and starts[-1] <= fwd[~before].min()  # the chunks ran between the two
    assert np.array_equal(placement_at(run, int(fwd.min())), first[moe])
    assert np.array_equal(placement_at(run), second[moe])

    row = {lid: i for i, lid in enumerate(moe)}
    bad = 0
    for f in np.unique(fwd):
        sel = fwd == f
        held = placement_at(run, int(f))[[row[x] for x in layer[sel]]]  # [rows, P]
        bad += int((np.take_along_axis(held, phys[sel], 1) != topk[sel]).sum())
    assert bad == 0  # every row's slots hold its experts under its own forward's map
    last = second[moe][[row[x] for x in layer]]
    assert (np.take_along_axis(last, phys, 1) != topk).any()  # the last map alone misreads the first request

    sql = TraceStore(store).query(  # the same join in plain SQL over the placements view
        "SELECT count(*) AS bad FROM routes r, LATERAL (SELECT p.phy2log FROM placements p WHERE p.run_id = r.run_id"
        " AND p.layer_id = r.layer_id AND p.from_forward_id <= r.forward_id ORDER BY p.from_forward_id DESC LIMIT 1)"
        " m WHERE list_transform(r.physical_ids, lambda s: m.phy2log[s + 1]) <> r.topk_ids")
    assert sql["bad"][0] == 0
