"""The corner of the balance / nodes-per-token trade-off, proven on small shapes with the exact MILP.

Question (issue 25): where ours cannot reach DeepSeek global's balancedness and its own nodes per token at once,
is that the planner's fault or the shape's? On one layer, in sample, bench/eplb_milp.py's program answers it from
both sides with a proven bound (HiGHS' dual bound, valid whether or not the search finished):
  nodes floor    fewest nodes per token of any placement whose max GPU load is <= M (M = a policy's own max
                 load; at global's M: the fewest nodes global's balance allows);
  balance roof   the highest balancedness (mean / max GPU load) of any placement whose mean nodes per token is
                 <= v (v = a policy's own nodes per token; at ours' v: the best balance ours' locality allows).
The corner is proven where the balance roof at ours' nodes per token is below global's balancedness (no
placement has both), and open where a placement with both exists (the MILP's incumbent shows one) or the bound
is too loose to tell. Same model as the EPLB tables: max GPU load under the even split of each expert's load over
its replicas; nodes per token = the fewest nodes holding all of a token's experts.

Run:   .venv/bin/python -m bench.eplb_corner [--instances synth-e16 synth-e32] [--time-limit 60]
Smoke: .venv/bin/python -m bench.eplb_corner --smoke   (synth-e16, 20 s a solve, nothing written)
Shape legend: E experts, T tokens, K top-k.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_milp import EVEN_SPLIT, INSTANCES, NoPlacement, bench_args, instance, placement_objectives, solve
from r3trace.eplb import Cluster, global_policy, hierarchical, plan
from r3trace.eplb.placement import Placement

# shapes small enough for the nodes program to finish (the 32-expert ones of bench/eplb_milp.py find no placement
# for it in 60 s): Zipf(0.8) tokens as there; (experts, top-k, tokens, GPUs, nodes, slots, groups)
SMALL = {"synth-e12": (12, 2, 24, 4, 2, 16, 4), "synth-e16x4": (16, 2, 32, 8, 4, 24, 4)}


def policy_placements(load: np.ndarray, tokens: np.ndarray, cl: Cluster) -> dict[str, Placement]:
    """load [E], tokens [T, K] -> {policy: its placement of the one layer}."""
    # the even split's max load and nodes per token are the objectives: ours plans for the even split
    pols: dict[str, Placement] = {"ours": plan(load[None], cl, tokens=tokens[:, None], cfg=EVEN_SPLIT),
                                  "global": global_policy(load[None], cl)}
    if cl.num_groups % cl.num_nodes == 0:
        pols["hierarchical"] = hierarchical(load[None], cl)
    return pols


def _any_count(load: np.ndarray, cl: Cluster) -> int:
    """Replicas one expert may get, P - E + 1: the bounds hold for every placement, not only those with the
    4 replicas at most that bench/eplb_milp.py's heuristic comparison allows."""
    return cl.num_slots - len(load) + 1


def nodes_floor(load: np.ndarray, tokens: np.ndarray, cl: Cluster, max_load: float, time_limit: float,
                incumbent: Placement | None = None) -> dict[str, Any]:
    """Proven lower bound (and best placement found) on nodes per token with max GPU load <= max_load; incumbent:
    a placement known to meet the cap (the policy's own), a cutoff and the answer where HiGHS finds none better."""
    try:
        r = solve(load, tokens, cl, "nodes", max_load_cap=max_load * (1 + 1e-9), time_limit=time_limit,
                  max_replicas=_any_count(load, cl), incumbent=incumbent)
        return {"bound": r.bound, "found": r.nodes, "found_max_load": r.max_load, "optimal": r.optimal}
    except NoPlacement as err:
        return {"bound": err.bound, "found": None, "found_max_load": None, "optimal": False}


def balance_roof(load: np.ndarray, tokens: np.ndarray, cl: Cluster, nodes: float, time_limit: float,
                 incumbent: Placement | None = None) -> dict[str, Any]:
    """Proven upper bound on balancedness (mean / max GPU load) with mean nodes per token <= nodes; incumbent as
    in nodes_floor."""
    mean = float(load.sum()) / cl.num_gpus
    try:
        r = solve(load, tokens, cl, "balance", nodes_cap=nodes + 1e-9, time_limit=time_limit,
                  max_replicas=_any_count(load, cl), incumbent=incumbent)
        return {"roof": mean / r.bound, "found": mean / r.max_load, "found_nodes": r.nodes, "optimal": r.optimal}
    except NoPlacement as err:
        return {"roof": mean / err.bound if err.bound > 0 else 1.0, "found": None, "found_nodes": None,
                "optimal": False}


def corner(name: str, time_limit: float) -> dict[str, Any]:
    """One instance: the policies' points, the nodes floor at each policy's max load, the balance roof at each
    policy's nodes per token, and the verdict on ours vs global."""
    load, tok, cl = instance(name, spec=SMALL.get(name))
    mean = float(load.sum()) / cl.num_gpus
    out: dict[str, Any] = {"instance": name, "mean_gpu_load": mean, "points": {}}
    for pol, pl in policy_placements(load, tok, cl).items():  # the policy's own placement meets both caps
        mx, nd = placement_objectives(pl, load, tok, cl)
        out["points"][pol] = {"max_load": mx, "balancedness": mean / mx, "nodes": nd,
                              "nodes_floor_at_its_max_load": nodes_floor(load, tok, cl, mx, time_limit, pl),
                              "balance_roof_at_its_nodes": balance_roof(load, tok, cl, nd, time_limit, pl)}
        print(f"{name} {pol}: bal {mean / mx:.4f} nodes {nd:.3f} | "
              f"floor {out['points'][pol]['nodes_floor_at_its_max_load']} | "
              f"roof {out['points'][pol]['balance_roof_at_its_nodes']}", flush=True)
    g, o = out["points"]["global"], out["points"]["ours"]
    roof = o["balance_roof_at_its_nodes"]["roof"]
    if roof < g["balancedness"] - 1e-9:
        out["verdict"] = (f"proven corner: no placement with ours' {o['nodes']:.3f} nodes per token reaches "
                          f"global's balancedness {g['balancedness']:.4f} (roof {roof:.4f})")
    elif o["balance_roof_at_its_nodes"]["found"] is not None and \
            o["balance_roof_at_its_nodes"]["found"] >= g["balancedness"] - 1e-9:
        out["verdict"] = (f"no corner: a placement with <= {o['nodes']:.3f} nodes per token reaches balancedness "
                          f"{o['balance_roof_at_its_nodes']['found']:.4f} >= global's {g['balancedness']:.4f}")
    else:
        out["verdict"] = f"open: roof {roof:.4f} >= global's {g['balancedness']:.4f}, no placement found reaching it"
    print(f"{name}: {out['verdict']}", flush=True)
    return out


def main() -> None:
    args = bench_args(__doc__ or "", "eplb-corner.json", ["synth-e12", "synth-e16", "synth-e16x4", "synth-e32"],
                      [*SMALL, *INSTANCES], 60.0)
    rows = [corner(name, args.time_limit) for name in args.instances]
    if args.out:
        Path(args.out).write_text(json.dumps({"time_limit": args.time_limit, "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
