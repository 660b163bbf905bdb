"""The corner bounds of bench/eplb_corner.py (HiGHS' proven bounds on the trade-off) against brute force: every
placement of a tiny shape enumerated, its max GPU load and nodes per token computed by hand.
Run: .venv/bin/pytest tests/analysis/test_eplb_corner.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from bench.eplb_corner import balance_roof, nodes_floor
from r3trace.eplb import Cluster
from tests.analysis.brute_placements import placement_points

CL = Cluster(4, 2, 8, num_groups=1)  # 4 GPUs of 2 slots, 2 nodes; 4 experts
E = 4


def _instance() -> tuple[np.ndarray, np.ndarray]:
    """(load [E], tokens [T, K=2]): seeded Zipf(1) choices, loads = their counts."""
    rng = np.random.default_rng(5)
    pop = 1 / np.arange(1, E + 1)
    tok = np.stack([rng.choice(E, 2, replace=False, p=pop / pop.sum()) for _ in range(10)])
    return np.bincount(tok.ravel(), minlength=E).astype(float), tok


@pytest.fixture(scope="module")
def case() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    load, tok = _instance()
    return load, tok, placement_points(load, tok)


def test_nodes_floor_is_the_brute_force_minimum(case: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    load, tok, pts = case
    for cap in np.unique(pts[:, 0])[:4]:  # the tightest balances, where the floor binds
        best = pts[pts[:, 0] <= cap + 1e-9, 1].min()
        got = nodes_floor(load, tok, CL, float(cap), time_limit=30)
        assert got["bound"] <= best + 1e-6  # a valid lower bound
        assert got["optimal"] and got["found"] == pytest.approx(best)  # and here the exact one
        assert got["found_max_load"] <= cap + 1e-9


def test_balance_roof_is_the_brute_force_maximum(case: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    load, tok, pts = case
    mean = load.sum() / CL.num_gpus
    assert pts[:, 1].min() < pts[pts[:, 0] == pts[:, 0].min(), 1].min()  # a real trade-off on this instance
    for cap in np.unique(pts[:, 1])[:3]:
        best = mean / pts[pts[:, 1] <= cap + 1e-9, 0].min()
        got = balance_roof(load, tok, CL, float(cap), time_limit=30)
        assert got["roof"] >= best - 1e-6  # a valid upper bound
        assert got["optimal"] and got["found"] == pytest.approx(best)
        assert got["found_nodes"] <= cap + 1e-9


def test_a_policys_own_placement_is_the_answer_where_highs_finds_none(
        case: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """Stopped before HiGHS has a placement (1 us), the nodes floor at a placement's own max load still reports that
    placement as found (bench/eplb_corner.py passes each policy's own), where without it nothing is found; the
    balance roof (whose search gets 1 s at least) finds one at least as balanced as it."""
    from bench.eplb_milp import placement_objectives
    from r3trace.eplb.placement import from_phy2log

    load, tok, _ = case
    pl = from_phy2log(np.array([[0, 1, 2, 3, 0, 1, 2, 3]]), E)
    mx, nodes = placement_objectives(pl, load, tok, CL)
    floor = nodes_floor(load, tok, CL, mx, time_limit=1e-6, incumbent=pl)
    assert floor["found"] == pytest.approx(nodes) and floor["found_max_load"] == pytest.approx(mx)
    assert nodes_floor(load, tok, CL, mx, time_limit=1e-6)["found"] is None
    roof = balance_roof(load, tok, CL, nodes, time_limit=1e-6, incumbent=pl)
    assert roof["found"] >= load.sum() / 4 / mx - 1e-12 and roof["found_nodes"] <= nodes + 1e-12
