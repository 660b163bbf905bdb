"""The exact placement MILP (bench/eplb_milp.py, scipy's HiGHS) bounds every heuristic on the same instance.
Run: .venv/bin/python -m pytest tests/analysis/test_eplb_milp.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from bench.eplb_grace import grace_policy
from bench.eplb_milp import placement_objectives, solve
from r3trace.eplb import Cluster, global_policy, hierarchical, plan
from r3trace.eplb.placement import check_placement

CL = Cluster(4, 2, 16, num_groups=4)  # 12 experts, 4 extra slots, 2 GPUs per node


def _instance(seed: int, e: int = 12, k: int = 2, t: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(load [E], tokens [T, K]): Zipf(0.8) choices of K distinct experts per token, loads = their counts."""
    rng = np.random.default_rng(seed)
    pop = 1 / np.arange(1, e + 1) ** 0.8
    tok = np.stack([rng.choice(e, k, replace=False, p=pop / pop.sum()) for _ in range(t)])
    return np.bincount(tok.ravel(), minlength=e).astype(float), tok


def _heuristics(load: np.ndarray, tok: np.ndarray) -> dict[str, object]:
    w = load[None]
    return {"ours": plan(w, CL, tokens=tok[:, None]), "global": global_policy(w, CL),
            "hierarchical": hierarchical(w, CL), "grace": grace_policy(w, CL, tok[:, None])}


def test_balance_optimum_is_at_most_every_heuristic_and_at_least_the_mean() -> None:
    load, tok = _instance(3)
    best = solve(load, tok, CL, "balance", max_replicas=3, time_limit=60)
    assert best.optimal
    check_placement(best.placement, CL)
    assert best.max_load >= load.sum() / CL.num_gpus - 1e-9  # no GPU can be below the mean at the max
    mx, _ = placement_objectives(best.placement, load, tok, CL)
    assert mx == pytest.approx(best.max_load)  # the solver's objective is the scorer's even-split max
    for name, pl in _heuristics(load, tok).items():
        assert best.max_load <= placement_objectives(pl, load, tok, CL)[0] + 1e-9, name
    # this instance's optimum: 32 units on 4 GPUs, perfectly balanced (ours 8.5, global 8.33, hierarchical 10)
    assert best.max_load == pytest.approx(8.0)


def test_fewest_nodes_at_a_heuristics_balance_is_at_most_its_nodes() -> None:
    load, tok = _instance(4)
    for name, pl in _heuristics(load, tok).items():
        mx, nodes = placement_objectives(pl, load, tok, CL)
        exact = solve(load, tok, CL, "nodes", max_load_cap=mx, max_replicas=3, time_limit=60)
        assert exact.optimal, name
        assert exact.max_load <= mx + 1e-9 and exact.nodes <= nodes + 1e-9, name
        assert exact.nodes == pytest.approx(exact.bound), name  # proved: the incumbent meets the bound
