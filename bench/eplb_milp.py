"""The exact placement of one MoE layer as a mixed-integer program (scipy's HiGHS MILP), for small shapes.

Objectives, as the topology-aware ILP of arXiv 2508.09229 states them (expected transmissions there, expected
nodes per token here):
  max GPU load  M = max_g sum_e load_e x_eg / c_e  (the even split of each expert's load over its c_e replicas)
  nodes/token     = mean over tokens of the fewest nodes that hold all of the token's K experts
The program and its cuts: bench/eplb_milp_model.py. Two solves: "balance" minimises M alone; "nodes" minimises
nodes per token with M <= a given cap (the heuristic's own M, so the answer says how many nodes that balance
could have cost at best).

Balance solves aim first: the bound max(total / G, max_e load_e / C), rounded up to the grid of GPU loads, is
tried as a cap on M with no objective (half the time limit at most); every placement found there is optimal, and
a cap proven infeasible moves the bound one grid step up. Minimising M outright left HiGHS at 48.5 over a bound
of 48.0 after 60 s on sample-e32, where the capped search finds a 48.0 placement in 17 s. What time is left goes
to minimising M between the bound and the cutoff (a given incumbent's M).
Shape legend: E experts, G GPUs, N nodes, C most replicas, T tokens, K top-k.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from bench.eplb_milp_model import Model, build
from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.placement import Cluster, Placement, from_phy2log

# ours planned for the MILP's objective, the even split's max load and nodes per token: no two-node replay contest
# (dispatch_contest.py trades the even split for node-limited replay) and no static-even ladder (planner_config's
# "static" / "dynamic", for SGLang's dispatchers: on synth-e64 it took 37.0 where the even split's plan has the
# optimum, 36.0)
EVEN_SPLIT = PlannerConfig(replay_margin=-1.0)

AIM_SHARE = 0.5  # of the time limit, at most, for the capped search at the bound (module doc)


@dataclass(frozen=True)
class MilpResult:
    max_load: float  # M of the best placement found
    nodes: float  # its nodes per token on the instance's tokens
    bound: float  # proven lower bound of the objective (M for "balance", nodes for "nodes")
    optimal: bool  # the incumbent meets the bound (HiGHS' default MIP gap of 1e-4, or the aimed-at bound)
    seconds: float
    placement: Placement
    source: Literal["highs", "incumbent"]  # whose placement this is: HiGHS' own, or the incumbent given to it
    status: str  # HiGHS' stop of the last solve: optimal, time_limit, infeasible (no placement under the caps), ...
    gap: float  # (objective - bound) / objective of the placement returned, 0 where proven

    def summary(self, prefix: str) -> dict[str, object]:
        """The fields a results row keeps, each key starting with prefix (bench/eplb_milp.py's JSON)."""
        return {f"{prefix}{k}": v for k, v in (("source", self.source), ("status", self.status), ("gap", self.gap),
                                               ("seconds", self.seconds))}


STATUS = {0: "optimal", 1: "time_limit", 2: "infeasible", 3: "unbounded", 4: "other"}  # scipy milp's status codes


class NoPlacement(RuntimeError):
    """No incumbent within the time limit (or none exists); `bound` is HiGHS' proven bound all the same."""

    def __init__(self, message: str, bound: float) -> None:
        super().__init__(message)
        self.bound = bound


def solve(load: np.ndarray, tokens: np.ndarray, cluster: Cluster, objective: Literal["balance", "nodes"],
          max_load_cap: float | None = None, max_replicas: int = 4, time_limit: float = 60.0,
          nodes_cap: float | None = None, incumbent: Placement | None = None,
          counts: np.ndarray | None = None) -> MilpResult:
    """load [E] (one layer), tokens [T, K] expert ids -> the best placement for `objective` (module doc);
    max_load_cap / nodes_cap bound the other objective (nodes_cap: mean nodes per token over the tokens);
    incumbent: a known placement (e.g. ours), used as a cutoff where it meets the caps and the replica limit, and
    returned when HiGHS finds none better. counts [E]: every expert's replica count fixed (the best placement of
    those counts: a restriction of the program, so its optimum bounds the whole program's from above)."""
    t0 = time.perf_counter()
    load = np.asarray(load, dtype=float)
    tokens = np.asarray(tokens)
    e, g = len(load), cluster.num_gpus
    c_max = min(max_replicas, cluster.num_slots - e + 1)
    mdl = build(load, tokens, cluster, objective, c_max, objective == "nodes" or nodes_cap is not None)
    if counts is not None:
        if int(np.max(counts)) > c_max or int(np.sum(counts)) != cluster.num_slots:
            raise ValueError(f"counts: {int(np.sum(counts))} replicas, at most {int(np.max(counts))} an expert; the "
                             f"program has {cluster.num_slots} slots and at most {c_max} replicas an expert")
        fixed = np.zeros(mdl.z.shape)
        fixed[np.arange(e), np.asarray(counts) - 1] = 1
        mdl = replace(mdl, lo=mdl.lo.copy(), hi=mdl.hi.copy())
        mdl.lo[mdl.z.ravel()] = fixed.ravel()
        mdl.hi[mdl.z.ravel()] = fixed.ravel()
    q = mdl.scale
    hi_m = np.inf if max_load_cap is None else np.floor(max_load_cap * q * (1 + 1e-12) + 1e-9)
    hi_nodes = np.inf if nodes_cap is None else nodes_cap * mdl.weight_sum * (1 + 1e-12) + 1e-9
    inc = None
    if incumbent is not None and np.bincount(incumbent.phy2log[0], minlength=e).max() <= c_max:
        inc_m, inc_nodes = placement_objectives(incumbent, load, tokens, cluster)
        if inc_m * q <= hi_m + 1e-6 and inc_nodes * mdl.weight_sum <= hi_nodes + 1e-6:
            inc = (incumbent, inc_m, inc_nodes)
            if objective == "balance":
                hi_m = min(hi_m, np.floor(inc_m * q + 1e-6))
            elif mdl.nodes_row is not None:
                hi_nodes = min(hi_nodes, inc_nodes * mdl.weight_sum + 1e-6)
    lb = max(load.sum() / g, load.max() / c_max) * q
    lb = float(np.ceil(lb - 1e-6)) if q > 1 else lb
    res = None
    if objective == "balance":
        while lb <= hi_m + 1e-9 and (left := AIM_SHARE * time_limit - (time.perf_counter() - t0)) > 0:
            res = _run(mdl, lb, lb, hi_nodes, left, aim=True)
            if res.x is not None or res.status != 2 or q == 1:
                break
            lb += 1  # the cap at lb is infeasible: M is at least one grid step more
        if res is None or res.x is None:
            res = _run(mdl, lb, hi_m, hi_nodes, max(time_limit - (time.perf_counter() - t0), 1.0), aim=False)
    else:
        res = _run(mdl, 0.0, hi_m, hi_nodes, time_limit, aim=False)
    dual = getattr(res, "mip_dual_bound", None)  # None where HiGHS stopped before a bound (presolve)
    dual = np.nan if dual is None else float(dual)
    if objective == "balance":
        bound = lb / q if not np.isfinite(dual) else max(lb / q, dual)
    else:  # every token needs one node at least; scipy gives no bound where HiGHS found no placement
        bound = 1.0 if not np.isfinite(dual) else max(1.0, dual / mdl.weight_sum)
    if res.x is None:
        if inc is None:
            raise NoPlacement(f"HiGHS found no placement in {time_limit} s: {res.message}", bound)
        pl = inc[0]
    else:
        x = np.rint(res.x[mdl.u]).astype(np.int64).sum(2)  # [E, G] replicas per GPU
        pl = from_phy2log(np.concatenate([np.repeat(np.arange(e), x[:, k]) for k in range(g)])[None], e)
    mx, nodes = placement_objectives(pl, load, tokens, cluster)
    best = mx if objective == "balance" else nodes
    optimal = bool(best <= bound + 1e-6 * max(abs(bound), 1.0)) or (res.x is not None and res.status == 0)
    gap = 0.0 if optimal else max(best - bound, 0.0) / max(abs(best), 1e-12)
    return MilpResult(mx, nodes, bound, optimal, time.perf_counter() - t0, pl,
                      "incumbent" if res.x is None else "highs", STATUS.get(res.status, str(res.status)), gap)


def _run(mdl: Model, m_lo: float, m_hi: float, nodes_hi: float, seconds: float, aim: bool) -> Any:
    """One HiGHS solve of mdl with scale x M in [m_lo, m_hi] and the cover sum <= nodes_hi; aim: no objective
    (any feasible placement ends the search)."""
    from scipy.optimize import LinearConstraint, milp

    lo, hi = mdl.lo.copy(), mdl.hi.copy()
    lo[mdl.m], hi[mdl.m] = m_lo, m_hi
    row_hi = mdl.row_hi.copy()
    if mdl.nodes_row is not None:
        row_hi[mdl.nodes_row] = nodes_hi
    cost = np.zeros_like(mdl.cost) if aim else mdl.cost
    return milp(cost, constraints=LinearConstraint(mdl.matrix, mdl.row_lo, row_hi), integrality=mdl.integrality,
                bounds=(lo, hi), options={"time_limit": seconds, "disp": False})


def placement_objectives(pl: Placement, load: np.ndarray, tokens: np.ndarray, cluster: Cluster) -> tuple[float, float]:
    """One layer: (max GPU load under the even split, mean over tokens [T, K] of the fewest covering nodes)."""
    from r3trace.eplb.score import even_gpu_load, node_limited

    mx = float(even_gpu_load(pl, np.asarray(load, dtype=float)[None], cluster).max())
    return mx, float(node_limited(pl, np.asarray(tokens)[:, None, :], cluster).nodes.mean())


INSTANCES = {  # name -> (experts, top-k, tokens, GPUs, nodes, slots, groups); the sample rows read layer 1 of it
    "synth-e16": (16, 2, 40, 4, 2, 20, 4),
    "synth-e32": (32, 4, 96, 8, 2, 40, 4),
    "sample-e32": (32, 4, 96, 8, 2, 40, 4),
    "synth-e64": (64, 6, 96, 16, 4, 80, 8),
}


def instance(name: str, seed: int = 0,
             spec: tuple[int, int, int, int, int, int, int] | None = None) -> tuple[np.ndarray, np.ndarray, Cluster]:
    """-> (load [E], tokens [T, K], cluster): Zipf(0.8) synthetic choices, or the sample model's first tokens;
    spec (experts, top-k, tokens, GPUs, nodes, slots, groups) for a shape not in INSTANCES."""
    e, k, t, g, n, p, gr = INSTANCES[name] if spec is None else spec
    if name.startswith("sample"):
        from bench.eplb_traces import sample_windows

        tok = sample_windows(1)[0][0, :t, 1]  # layer 1's first t tokens
    else:
        rng = np.random.default_rng(seed)
        pop = 1 / np.arange(1, e + 1) ** 0.8
        tok = np.stack([rng.choice(e, k, replace=False, p=pop / pop.sum()) for _ in range(t)])
    return np.bincount(tok.ravel(), minlength=e).astype(float), tok, Cluster(g, n, p, num_groups=gr)


def bench_args(description: str, out_name: str, instances: list[str], choices: list[str],
               time_limit: float, counts_flag: bool = False) -> argparse.Namespace:
    """The command line bench/eplb_milp.py and bench/eplb_corner.py share: --instances, --time-limit (seconds a
    solve), --out (under bench/results), --smoke (synth-e16, 20 s a solve, nothing written: make test); counts_flag
    adds bench/eplb_milp.py's --ours-counts."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", nargs="*", default=instances, choices=choices)
    ap.add_argument("--time-limit", type=float, default=time_limit, help="seconds per MILP solve")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / out_name))
    ap.add_argument("--smoke", action="store_true", help="synth-e16 only, 20 s a solve, nothing written")
    if counts_flag:
        ap.add_argument("--ours-counts", action="store_true",
                        help="only the fewest nodes at ours' own replica counts, into ours' rows of --out")
    args = ap.parse_args()
    if args.time_limit <= 0:
        ap.error(f"--time-limit={args.time_limit} must be > 0 seconds")
    if args.smoke:
        args.instances, args.time_limit, args.out = ["synth-e16"], 20.0, ""
    return args


def main() -> None:
    import json

    from bench.eplb_grace import grace_policy
    from r3trace.eplb import global_policy, hierarchical, plan

    args = bench_args(__doc__ or "", "eplb-matrix-milp.json", list(INSTANCES), list(INSTANCES), 120.0, True)
    if args.ours_counts:
        return ours_counts(args.instances, Path(args.out), args.time_limit)
    rows = []
    for name in args.instances:
        load, tok, cl = instance(name)
        # the MILP's objective is the even split's max load: ours plans for it (no two-node replay contest)
        pols = {"ours": plan(load[None], cl, tokens=tok[:, None], cfg=EVEN_SPLIT),
                "global": global_policy(load[None], cl),
                "grace": grace_policy(load[None], cl, tok[:, None])}
        best = solve(load, tok, cl, "balance", time_limit=args.time_limit, incumbent=pols["ours"])
        print(f"{name}: balance MILP {best.max_load:.2f} (bound {best.bound:.2f}, optimal {best.optimal}, "
              f"{best.seconds:.0f} s)", flush=True)
        if cl.num_groups % cl.num_nodes == 0:
            pols["hierarchical"] = hierarchical(load[None], cl)
        for pol, pl in pols.items():
            mx, nodes = placement_objectives(pl, load, tok, cl)
            fewest = None
            if pol in ("ours", "global"):
                try:
                    fewest = solve(load, tok, cl, "nodes", max_load_cap=mx, time_limit=args.time_limit, incumbent=pl)
                except RuntimeError as err:  # no incumbent within the limit: reported as such
                    print(f"  {pol}: {err}", flush=True)
            row = {"instance": name, "policy": pol, "max_load": mx, "nodes": nodes, "milp_max_load": best.max_load,
                   "milp_max_load_bound": best.bound, "milp_balance_optimal": best.optimal,
                   **best.summary("milp_balance_"),
                   "milp_nodes_at_max_load": None if fewest is None else fewest.nodes,
                   "milp_nodes_bound": None if fewest is None else fewest.bound,
                   "milp_nodes_optimal": None if fewest is None else fewest.optimal,
                   **(fewest.summary("milp_nodes_") if fewest is not None else {})}
            rows.append(row)
            print(f"  {pol}: max load {mx:.2f} ({mx / best.bound - 1:+.1%} vs bound), nodes {nodes:.3f}"
                  + ("" if fewest is None else f"; fewest nodes at that max load {fewest.nodes:.3f} "
                     f"(bound {fewest.bound:.3f}, optimal {fewest.optimal}, {fewest.source}, {fewest.status})"),
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"time_limit": args.time_limit, "rows": rows}, indent=1))


def ours_counts(names: list[str], out: Path, time_limit: float) -> None:
    """The fewest nodes per token among placements with ours' own replica counts at ours' max load, solved into
    ours' rows of an existing results file (whose other solves stay as they are). Fixing the counts removes the
    count choice that leaves the whole program's nodes bound at 1.0, so HiGHS proves this restricted optimum where
    it proves nothing of the whole; being a restriction, it bounds the whole optimum from above. Ours' placement
    must be the recorded one (same max load and nodes per token), else the row is left alone and said so."""
    import json

    from r3trace.eplb import plan

    doc = json.loads(out.read_text())
    for name in names:
        load, tok, cl = instance(name)
        pl = plan(load[None], cl, tokens=tok[:, None], cfg=EVEN_SPLIT)
        mx, nodes = placement_objectives(pl, load, tok, cl)
        row = next(r for r in doc["rows"] if r["instance"] == name and r["policy"] == "ours")
        if abs(row["max_load"] - mx) > 1e-9 or abs(row["nodes"] - nodes) > 1e-9:
            print(f"{name}: ours plans {mx:.3f} / {nodes:.4f}, the file has {row['max_load']:.3f} / "
                  f"{row['nodes']:.4f}: re-run the whole bench; row left alone", flush=True)
            continue
        counts = np.bincount(pl.phy2log[0], minlength=len(load))
        res = solve(load, tok, cl, "nodes", max_load_cap=mx, time_limit=time_limit, incumbent=pl, counts=counts)
        row.update({"milp_nodes_at_counts": res.nodes, "milp_nodes_at_counts_bound": res.bound,
                    "milp_nodes_at_counts_optimal": res.optimal, **res.summary("milp_nodes_at_counts_")})
        print(f"{name}: ours {nodes:.4f} nodes per token at {mx:.2f}; fewest with its counts {res.nodes:.4f} (bound "
              f"{res.bound:.4f}, optimal {res.optimal}, {res.source}, {res.seconds:.0f} s)", flush=True)
    out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
