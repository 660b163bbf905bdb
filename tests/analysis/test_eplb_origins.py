"""Each layer's origin in ours' plan (r3trace/eplb/origins.py): its own layout, DeepSeek global's on the same
forecast, or the previous placement's layer, by what the layer's GPUs hold."""

from __future__ import annotations

import numpy as np

from r3trace.eplb import Cluster, plan
from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.deepseek import global_phy2log
from r3trace.eplb.origins import layer_origins, origins_line
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.planner import planning_forecast

E, L = 16, 3
CL = Cluster(8, 2, 16, num_groups=4)


def history(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.gamma(0.6, 100.0, (4, L, E)).round() + 1.0  # [W, L, E] skewed counts


def test_origins_by_gpu_contents() -> None:
    h = history(0)
    w, _ = planning_forecast(h, None, PlannerConfig(), CL)
    glob = global_phy2log(w, CL)  # [L, P], two slots a GPU
    mixed = glob.copy()
    # layer 0: global's GPUs in another order and slots swapped inside GPUs (nodes differ, loads do not)
    gpus = mixed[0].reshape(8, 2)
    mixed[0] = gpus[[3, 0, 7, 1, 2, 6, 4, 5]][:, ::-1].ravel()
    # layer 1: two experts traded between GPUs 0 and 5 (another layout, whatever its loads)
    mixed[1, 0], mixed[1, 11] = glob[1, 11], glob[1, 0]
    got = layer_origins(from_phy2log(mixed, E), h, CL)
    assert got == ["global", "ours", "global"]
    # a re-plan: layer 2 equal to the previous placement's (GPUs reordered) reads "previous" first
    prev = mixed.copy()
    prev[2] = prev[2].reshape(8, 2)[::-1].ravel()
    prev[0, 0], prev[0, 3] = prev[0, 3], prev[0, 0]
    prev[1] = glob[1]
    got = layer_origins(from_phy2log(mixed, E), h, CL, from_phy2log(prev, E))
    # layers 0 and 1 differ from prev (the re-plan's forecast may move global's layer, so only that is checked)
    assert got[2] == "previous" and got[0] != "previous" and got[1] != "previous"


def test_replan_of_its_own_plan_reports_unchanged_layers() -> None:
    h = history(1)
    first = plan(h, CL)
    again = plan(h, CL, prev=first)
    got = layer_origins(again, h, CL, first)
    same = [a == b for a, b in zip(again.phy2log.tolist(), first.phy2log.tolist(), strict=True)]
    # a layer the re-plan left slot for slot is "previous"; one it changed is not
    assert all(o == "previous" for o, s in zip(got, same, strict=True) if s)
    line = origins_line(got, previous=True)
    n = {k: got.count(k) for k in ("ours", "global", "previous")}
    assert line == (f"layers: {n['ours']} ours, {n['global']} DeepSeek global's on the same forecast, "
                    f"{n['previous']} unchanged from --previous")
    assert origins_line(got, previous=False).endswith("on the same forecast")
