"""The exact placement of one MoE layer as a mixed-integer program (scipy's HiGHS MILP), for small shapes.

Decision: how many replicas each expert gets and which GPU holds each (several on one GPU allowed), P slots in
all, P / G per GPU. Objectives, as the topology-aware ILP of arXiv 2508.09229 states them (expected
transmissions there, expected nodes per token here):
  max GPU load  M = max_g sum_e load_e x_eg / c_e  (the even split of each expert's load over its c_e replicas)
  nodes/token     = mean over tokens of the fewest nodes that hold all of the token's K experts
Linearised: z[e, c] = 1 when expert e has c replicas (c = 1 .. C), u[e, g, c] = replicas of e on GPU g when it
has c, so load_e / c * u[e, g, c] is linear; y[e, n] = e has a replica on node n; per distinct token expert set
t, a[t, k, n] = its k-th expert served from node n (needs y), v[t, n] >= a[t, k, n] = node n in its cover.
Symmetry cuts (valid: GPUs of a node and nodes are interchangeable): GPU loads fall within each node, and nodes
are ordered by the load of their last (lightest) GPU.

Two solves: "balance" minimises M alone; "nodes" minimises nodes per token with M <= a given cap (the
heuristic's own M, so the answer says how many nodes that balance could have cost at best).
Shape legend: E experts, G GPUs, N nodes, C most replicas, T tokens, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from r3trace.eplb.placement import Cluster, Placement, from_phy2log


@dataclass(frozen=True)
class MilpResult:
    max_load: float  # M of the best placement found
    nodes: float  # its nodes per token on the instance's tokens
    bound: float  # proven lower bound of the objective (M for "balance", nodes for "nodes")
    optimal: bool  # HiGHS proved the incumbent optimal (within its default MIP gap of 1e-4)
    seconds: float
    placement: Placement


class NoPlacement(RuntimeError):
    """No incumbent within the time limit (or none exists); `bound` is HiGHS' proven bound all the same."""

    def __init__(self, message: str, bound: float) -> None:
        super().__init__(message)
        self.bound = bound


class _Vars:
    """Column index bookkeeping: named blocks of variables, flat in one vector."""

    def __init__(self) -> None:
        self.n = 0
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integ: list[int] = []

    def add(self, shape: tuple[int, ...], lo: float, hi: float | np.ndarray, integer: bool) -> np.ndarray:
        size = int(np.prod(shape))
        idx = np.arange(self.n, self.n + size).reshape(shape)
        self.n += size
        self.lo += [lo] * size
        self.hi += list(np.broadcast_to(np.asarray(hi, dtype=float), shape).ravel())
        self.integ += [int(integer)] * size
        return idx


def solve(load: np.ndarray, tokens: np.ndarray, cluster: Cluster, objective: Literal["balance", "nodes"],
          max_load_cap: float | None = None, max_replicas: int = 4, time_limit: float = 60.0,
          nodes_cap: float | None = None) -> MilpResult:
    """load [E] (one layer), tokens [T, K] expert ids -> the best placement for `objective` (module doc);
    max_load_cap / nodes_cap bound the other objective (nodes_cap: mean nodes per token over the tokens)."""
    import time

    from scipy.optimize import LinearConstraint, milp
    from scipy.sparse import coo_matrix

    t0 = time.perf_counter()
    e, g, n = len(load), cluster.num_gpus, cluster.num_nodes
    spg, gpn, c_max = cluster.slots_per_gpu, cluster.gpus_per_node, min(max_replicas, cluster.num_slots - e + 1)
    cs = np.arange(1, c_max + 1)
    sets, weight = np.unique(np.sort(np.asarray(tokens), axis=1), axis=0, return_counts=True)  # [T', K]
    use_tokens = objective == "nodes" or nodes_cap is not None
    var = _Vars()
    u = var.add((e, g, c_max), 0, np.minimum(spg, cs)[None, None, :], True)
    z = var.add((e, c_max), 0, 1, True)
    m = var.add((1,), 0, np.inf, False)[0]
    if use_tokens:
        y = var.add((e, n), 0, 1, True)
        a = var.add((len(sets), sets.shape[1], n), 0, 1, True)
        v = var.add((len(sets), n), 0, 1, True)
    rows: list[tuple[list[int], list[float], float, float]] = []  # (columns, coefficients, lower, upper)

    def row(cols: np.ndarray, coef: np.ndarray | float, lo: float, hi: float) -> None:
        cols = np.asarray(cols).ravel()
        rows.append((list(cols), list(np.broadcast_to(np.asarray(coef, float), cols.shape)), lo, hi))

    for i in range(e):
        row(z[i], 1.0, 1, 1)  # one replica count per expert
        for j, c in enumerate(cs):
            row(np.r_[u[i, :, j], z[i, j]], np.r_[np.ones(g), -c], 0, 0)  # sum_g u = c z
    for k in range(g):
        row(u[:, k, :], 1.0, spg, spg)  # every slot holds one replica
    gpu_load = [(u[:, k, :], (load[:, None] / cs[None, :])) for k in range(g)]
    for k in range(g):
        cols, coef = gpu_load[k]
        row(np.r_[cols.ravel(), m], np.r_[coef.ravel(), -1.0], -np.inf, 0)  # GPU load <= M
    for k in range(g - 1):  # symmetry: loads fall inside a node; nodes ordered by their last GPU
        nxt = k + 1 if (k + 1) % gpn else k + gpn
        if nxt >= g:
            continue
        (c1, f1), (c2, f2) = gpu_load[k], gpu_load[nxt]
        row(np.r_[c1.ravel(), c2.ravel()], np.r_[f1.ravel(), -f2.ravel()], 0, np.inf)
    if max_load_cap is not None:
        row([m], 1.0, -np.inf, max_load_cap)
    if use_tokens:
        for i in range(e):
            for node in range(n):
                gpus = u[i, node * gpn:(node + 1) * gpn, :]
                row(np.r_[y[i, node], gpus.ravel()], np.r_[1.0, -np.ones(gpus.size)], -np.inf, 0)  # y <= replicas
        for t, ids in enumerate(sets):
            for k, ex in enumerate(ids):
                row(a[t, k], 1.0, 1, 1)  # each chosen expert served from one node
                for node in range(n):
                    row([a[t, k, node], y[ex, node]], [1.0, -1.0], -np.inf, 0)
                    row([a[t, k, node], v[t, node]], [1.0, -1.0], -np.inf, 0)
    if nodes_cap is not None:
        row(v, np.repeat(weight / weight.sum(), n), -np.inf, nodes_cap)
    cost = np.zeros(var.n)
    if objective == "nodes":
        cost[v.ravel()] = np.repeat(weight / weight.sum(), n)
    else:
        cost[m] = 1.0
    r_idx = np.concatenate([[i] * len(c) for i, (c, _, _, _) in enumerate(rows)])
    mat = coo_matrix((np.concatenate([f for _, f, _, _ in rows]), (r_idx, np.concatenate([c for c, _, _, _ in rows]))),
                     shape=(len(rows), var.n)).tocsr()
    res = milp(cost, constraints=LinearConstraint(mat, [r[2] for r in rows], [r[3] for r in rows]),
               integrality=np.asarray(var.integ), bounds=(var.lo, var.hi),
               options={"time_limit": time_limit, "disp": False})
    if res.x is None:
        dual = getattr(res, "mip_dual_bound", None)  # None where HiGHS stopped before a bound (presolve)
        raise NoPlacement(f"HiGHS found no placement in {time_limit} s: {res.message}",
                          np.nan if dual is None else float(dual))
    x = np.rint(res.x[u]).astype(np.int64).sum(2)  # [E, G] replicas per GPU
    phy2log = np.concatenate([np.repeat(np.arange(e), x[:, k]) for k in range(g)])[None]
    pl = from_phy2log(phy2log, e)
    mx, nodes = placement_objectives(pl, load, tokens, cluster)
    bound = float(getattr(res, "mip_dual_bound", np.nan))
    return MilpResult(mx, nodes, bound, res.status == 0, time.perf_counter() - t0, pl)


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


def main() -> None:
    import argparse
    import json
    from pathlib import Path

    from bench.eplb_grace import grace_policy
    from r3trace.eplb import global_policy, hierarchical, plan

    ap = argparse.ArgumentParser(description="exact placement MILP vs the heuristics, in sample (module doc)")
    ap.add_argument("--instances", nargs="*", default=list(INSTANCES))
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per MILP solve")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "eplb-matrix-milp.json"))
    ap.add_argument("--smoke", action="store_true", help="synth-e16 only, 20 s a solve, nothing written (make test)")
    args = ap.parse_args()
    if args.smoke:
        args.instances, args.time_limit, args.out = ["synth-e16"], 20.0, ""
    rows = []
    for name in args.instances:
        load, tok, cl = instance(name)
        best = solve(load, tok, cl, "balance", time_limit=args.time_limit)
        print(f"{name}: balance MILP {best.max_load:.2f} (bound {best.bound:.2f}, optimal {best.optimal}, "
              f"{best.seconds:.0f} s)", flush=True)
        pols = {"ours": plan(load[None], cl, tokens=tok[:, None]), "global": global_policy(load[None], cl),
                "grace": grace_policy(load[None], cl, tok[:, None])}
        if cl.num_groups % cl.num_nodes == 0:
            pols["hierarchical"] = hierarchical(load[None], cl)
        for pol, pl in pols.items():
            mx, nodes = placement_objectives(pl, load, tok, cl)
            fewest = None
            if pol in ("ours", "global"):
                try:
                    fewest = solve(load, tok, cl, "nodes", max_load_cap=mx, time_limit=args.time_limit)
                except RuntimeError as err:  # no incumbent within the limit: reported as such
                    print(f"  {pol}: {err}", flush=True)
            row = {"instance": name, "policy": pol, "max_load": mx, "nodes": nodes, "milp_max_load": best.max_load,
                   "milp_max_load_bound": best.bound, "milp_balance_optimal": best.optimal,
                   "milp_nodes_at_max_load": None if fewest is None else fewest.nodes,
                   "milp_nodes_bound": None if fewest is None else fewest.bound,
                   "milp_nodes_optimal": None if fewest is None else fewest.optimal}
            rows.append(row)
            print(f"  {pol}: max load {mx:.2f} ({mx / best.bound - 1:+.1%} vs bound), nodes {nodes:.3f}"
                  + ("" if fewest is None else f"; fewest nodes at that max load {fewest.nodes:.3f} "
                     f"(bound {fewest.bound:.3f}, optimal {fewest.optimal})"), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"time_limit": args.time_limit, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
