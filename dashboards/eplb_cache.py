"""The EPLB page's cached calls into r3trace.eplb (store_cache.py's rules: a `st.cache_data` per result, its
arguments all of its inputs, store path first; cleared with every other cached result when the store changes)."""

from __future__ import annotations

from typing import Any

import streamlit as st

from r3trace.dashboards.store_cache import open_store, run_row

# the page's policy for `r3trace eplb --keep-groups`: r3trace.eplb.report_figures.KEEP_GROUPS, the trade-off series of
# the same plan (not imported here: the planner loads with the first plan, not with the page)
KEEP_GROUPS = "ours, groups kept"


@st.cache_data(show_spinner=False)
def placement_history(path: str, run_id: str) -> str:
    """The run's recorded placements in one line (placements.history_line), "" when it records none."""
    from r3trace.trace.placements import history_line, switches

    files = open_store(path).run(run_id)
    return history_line(switches(files)) if files.manifest.placements else ""


@st.cache_data(show_spinner=False)
def eplb_default_train(path: str, run_id: str) -> str:
    """The first 3/4 of the run (by rollup windows, or forwards when it spans one) as a --train window, so the
    rest is held out; "" when the run cannot be split."""
    from r3trace.eplb.loads import run_facts
    from r3trace.eplb.window import leading

    store = open_store(path)
    spec = leading(run_facts(store.con, [store.run(run_id)])[run_id])
    return "" if spec is None else str(spec)


@st.cache_data(show_spinner=False)
def eplb_report(path: str, run_id: str, gpus: int, nodes: int, slots: int, policy: str, node_limit: int,
                max_tokens: int, train: str, held_out: str, previous: str = "") -> dict[str, Any]:
    """`r3trace eplb`'s report (r3trace/eplb/report.py) for the page: windows, the backtest, in-sample and
    held-out scores (per layer too), the trade-off over policies x node limits 1..min(N, 8), per-GPU loads
    [L, G] before (trivial placement) and after the plan on the scored window, phy2log [L, P] / logcnt, and SGLang's
    physical_to_logical_map [num_hidden_layers, P]. previous: the placement the cluster runs (`r3trace eplb
    --previous`: an --out JSON's or SGLang's location file's path, "recorded": the run's own placements table, the
    map in force at the training window's end; "":
    none), then the plan's "before" and its scores."""
    import argparse

    from r3trace.eplb.placement import Cluster, Placement, sglang_map
    from r3trace.eplb.plan_request import PlanRequest
    from r3trace.eplb.previous import RECORDED, read_previous, recorded_previous
    from r3trace.eplb.report import make_report
    from r3trace.eplb.report_figures import gpu_loads, tradeoff
    from r3trace.eplb.window import window_spec

    run = run_row(path, run_id)
    cluster = Cluster(num_gpus=gpus, num_nodes=nodes, num_slots=slots, num_groups=int(run["num_groups"]),
                      node_limit=node_limit)
    try:
        specs = [window_spec(t.strip()) if t.strip() else None for t in (train, held_out)]
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from e
    by_runs = any(sp is not None and sp.kind == "runs" for sp in specs)
    kept: Placement | str | None = None
    if previous.strip() == RECORDED:  # read at the training window's end by make_report; checked here first
        recorded_previous(open_store(path).run(run_id), cluster)
        kept = RECORDED
    elif previous.strip():
        kept = read_previous(previous.strip(), cluster, int(run["num_hidden_layers"]), tuple(run["moe_layer_ids"]),
                             int(run["num_experts"]))
    keep = policy == KEEP_GROUPS
    req = PlanRequest(cluster, "ours" if keep else policy, None, specs[0], specs[1],  # type: ignore[arg-type]
                      None if by_runs else run_id, replay_tokens=max_tokens, previous=kept, keep_groups=keep)
    rep = make_report(open_store(path), req)
    before, after = gpu_loads(rep, cluster, rep.previous)
    held = rep.held
    return {
        **rep.to_dict(), "layers": list(run["moe_layer_ids"]), "slots_per_gpu": cluster.slots_per_gpu,
        "phy2log": rep.placement.phy2log, "logcnt": rep.placement.logcnt,
        # SGLang's --init-expert-location rows: every layer by its id (`r3trace eplb --sglang`'s file)
        "sglang_map": sglang_map(rep.placement, int(run["num_hidden_layers"]), tuple(run["moe_layer_ids"])),
        "scored_on": "held out" if held is not None else "in-sample",
        "per_layer": {"in_even": rep.in_sample.even, "in_replay": rep.in_sample.replay,
                      "held_even": None if held is None else held.even,
                      "held_replay": None if held is None else held.replay},
        "tradeoff": [p._asdict() for p in tradeoff(rep, cluster, range(1, min(nodes, 8) + 1))],
        "gpu_before": before, "gpu_after": after,
    }
