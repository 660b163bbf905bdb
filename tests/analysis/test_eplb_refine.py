"""refine.swap_refine (swaps on each layer's hottest GPU): layers in blocks equal one call, and what a swap may do.
Run: .venv/bin/pytest tests/analysis/test_eplb_refine.py -q"""

from __future__ import annotations

import numpy as np
import pytest

from r3trace.eplb import Cluster, refine
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.refine import swap_refine
from r3trace.eplb.score import phy2log_gpu_load


def _case(seed: int, cl: Cluster, n_layers: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """phy2log [L, P] (every expert once, the spare slots to random experts, shuffled), Pareto loads [L, E], counts."""
    rng = np.random.default_rng(seed)
    ph = np.stack([rng.permutation(np.concatenate([np.arange(e), rng.integers(0, e, cl.num_slots - e)]))
                   for _ in range(n_layers)])
    w = rng.pareto(1.2, (n_layers, e)) + 0.05
    return ph, w, from_phy2log(ph, e).logcnt


@pytest.mark.parametrize("seed", range(3))
def test_blocks_of_layers_equal_one_call(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cl = Cluster(6, 2, 42)  # 7 slots a GPU
    ph, w, cnt = _case(seed, cl, 9, 29)
    whole = swap_refine(ph, w, cnt, cl, 12, 1e-4)
    for layers in (1, 2, 4):  # layers a block (the last one short)
        monkeypatch.setattr(refine, "REFINE_BLOCK", layers * 7 * 42)
        assert np.array_equal(swap_refine(ph, w, cnt, cl, 12, 1e-4), whole)


@pytest.mark.parametrize("cross", [True, False])
def test_swaps_lower_the_max_and_keep_nodes(cross: bool) -> None:
    cl = Cluster(8, 2, 40)  # 5 slots a GPU
    ph, w, cnt = _case(7, cl, 6, 31)
    out = swap_refine(ph, w, cnt, cl, 20, 0.0, cross_nodes=cross)
    assert (out != ph).any()  # the random layouts leave swaps to take
    np.testing.assert_array_equal(from_phy2log(out, 31).logcnt, cnt)  # swaps keep every count
    before, after = phy2log_gpu_load(ph, w, cl).max(1), phy2log_gpu_load(out, w, cl).max(1)
    assert (after <= before + 1e-12).all() and (after < before).any()
    node = cl.slot_node()
    for layer in range(len(ph)):  # a replica changes node only where it is its expert's only one (cross_nodes)
        for q in np.flatnonzero(out[layer] != ph[layer]):
            x = out[layer, q]
            if node[q] not in set(node[ph[layer] == x].tolist()):
                assert cross and cnt[layer, x] == 1
