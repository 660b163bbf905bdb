"""The placement integer program of bench/eplb_milp.py: its variables, rows and the cuts that tighten it.

Decision: how many replicas each expert gets and which GPU holds each (several on one GPU allowed), P slots in
all, P / G per GPU. Linearised: z[e, c] = 1 when expert e has c replicas (c = 1 .. C), u[e, g, c] = replicas of
e on GPU g when it has c, so load_e / c * u[e, g, c] is linear; y[e, n] = e has a replica on node n; per distinct
token expert set t, a[t, k, n] = its k-th expert served from node n (needs y), v[t, n] >= a[t, k, n] = node n in
its cover.

Tightening (every cut keeps at least one optimal placement; tests/analysis/test_eplb_milp.py checks the optima
against brute force):
  grid        with integer loads every GPU load is a multiple of 1 / lcm(1 .. C), so M is that integer over
              lcm(1 .. C) and HiGHS rounds its bound up to the grid (48.01 proves 48.083 on sample-e32);
              the nodes objective counts token-sets (integer weights), rounded the same way;
  VUB         u[e, g, c] <= min(S, c) z[e, c]: a GPU holds count-c replicas of e only when e has c (the LP
              spread fractions of one replica over every GPU without it);
  expert      M >= load_e / c_e: one replica's share is on some GPU;
  symmetry    GPUs are interchangeable, and so are nodes. Balance alone: GPU loads fall from GPU 0 to G - 1.
              With tokens: GPU loads fall inside each node, and nodes are ordered by their last GPU's load
              (permuting GPUs inside a node, or whole nodes, changes no token's cover);
  cutoff      M <= a known placement's M (bench/eplb_milp.py passes ours' or a target from the grid) and the
              nodes objective <= a known placement's, which prune the search without cutting off the optimum.
Shape legend: E experts, G GPUs, N nodes, C most replicas, T' distinct token sets, K top-k, S slots per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

import numpy as np

from r3trace.eplb.placement import Cluster


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


@dataclass(frozen=True)
class Model:
    """One program, ready for scipy.optimize.milp; M = x[m] / scale, nodes per token = cost.x / weight_sum."""

    cost: np.ndarray  # [X]
    matrix: object  # scipy.sparse CSR [R, X]
    row_lo: np.ndarray  # [R]
    row_hi: np.ndarray  # [R]
    integrality: np.ndarray  # [X]
    lo: np.ndarray  # [X]
    hi: np.ndarray  # [X]
    u: np.ndarray  # [E, G, C] column ids
    z: np.ndarray  # [E, C] column ids: z[e, c - 1] = 1 when expert e has c replicas
    m: int  # column of scale * M
    scale: int  # lcm(1 .. C) with integer loads, else 1 (M continuous)
    nodes_row: int | None  # row of the nodes-per-token cap (weight-sum units), when tokens are modelled
    weight_sum: int  # tokens behind the distinct sets


def build(load: np.ndarray, tokens: np.ndarray, cluster: Cluster, objective: str, c_max: int,
          use_tokens: bool) -> Model:
    """load [E], tokens [T, K] -> the program for objective "balance" (min M) or "nodes" (min nodes per token);
    caps on the other objective are set on the returned bounds (bench/eplb_milp.py)."""
    from scipy.sparse import coo_matrix

    e, g, n = len(load), cluster.num_gpus, cluster.num_nodes
    spg, gpn = cluster.slots_per_gpu, cluster.gpus_per_node
    cs = np.arange(1, c_max + 1)
    integer_loads = bool(np.all(load == np.rint(load)))
    scale = lcm(*cs.tolist()) if integer_loads else 1
    sets, weight = np.unique(np.sort(np.asarray(tokens), axis=1), axis=0, return_counts=True)  # [T', K]
    var = _Vars()
    u = var.add((e, g, c_max), 0, np.minimum(spg, cs)[None, None, :], True)
    z = var.add((e, c_max), 0, 1, True)
    m = int(var.add((1,), 0, np.inf, integer_loads)[0])
    if use_tokens:
        y = var.add((e, n), 0, 1, True)
        a = var.add((len(sets), sets.shape[1], n), 0, 1, True)
        v = var.add((len(sets), n), 0, 1, True)
    rows: list[tuple[np.ndarray, np.ndarray, float, float]] = []  # (columns, coefficients, lower, upper)

    def row(cols: np.ndarray | list[int], coef: np.ndarray | float | list[float], lo: float, hi: float) -> None:
        c = np.asarray(cols).ravel()
        rows.append((c, np.broadcast_to(np.asarray(coef, float), c.shape).astype(float), lo, hi))

    share = scale * load[:, None] / cs[None, :]  # [E, C] scale x one replica's load
    for i in range(e):
        row(z[i], 1.0, 1, 1)  # one replica count per expert
        row(np.r_[z[i], m], np.r_[share[i], -1.0], -np.inf, 0)  # expert cut: M >= load_e / c_e
        for j, c in enumerate(cs):
            row(np.r_[u[i, :, j], z[i, j]], np.r_[np.ones(g), -c], 0, 0)  # sum_g u = c z
            for k in range(g):  # VUB: count-c replicas only when e has c
                row([u[i, k, j], z[i, j]], [1.0, -float(min(spg, int(c)))], -np.inf, 0)
    for k in range(g):
        row(u[:, k, :], 1.0, spg, spg)  # every slot holds one replica
        row(np.r_[u[:, k, :].ravel(), m], np.r_[share.ravel(), -1.0], -np.inf, 0)  # GPU load <= M
    for k, nxt in _load_order(g, gpn if use_tokens else g):  # symmetry: GPU k at least as loaded as nxt
        row(np.r_[u[:, k, :].ravel(), u[:, nxt, :].ravel()], np.r_[share.ravel(), -share.ravel()], 0, np.inf)
    nodes_row = None
    cost = np.zeros(var.n)
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
        nodes_row = len(rows)
        row(v, np.repeat(weight.astype(float), n), -np.inf, np.inf)  # sum of covers, in tokens; capped by caller
        if objective == "nodes":
            cost[v.ravel()] = np.repeat(weight.astype(float), n)
    if objective != "nodes":
        cost[m] = 1.0 / scale
    r_idx = np.concatenate([np.full(len(c), i) for i, (c, _, _, _) in enumerate(rows)])
    mat = coo_matrix((np.concatenate([f for _, f, _, _ in rows]), (r_idx, np.concatenate([c for c, _, _, _ in rows]))),
                     shape=(len(rows), var.n)).tocsr()
    return Model(cost, mat, np.array([r[2] for r in rows]), np.array([r[3] for r in rows]),
                 np.asarray(var.integ), np.asarray(var.lo, float), np.asarray(var.hi, float), u, z, m, scale,
                 nodes_row, int(weight.sum()))


def _load_order(g: int, gpn: int) -> list[tuple[int, int]]:
    """(k, next) pairs of the symmetry order: inside each run of gpn GPUs each GPU before the next, and each
    run's last GPU before the next run's last (gpn = G: one chain over every GPU)."""
    out = []
    for k in range(g - 1):
        nxt = k + 1 if (k + 1) % gpn else k + gpn
        if nxt < g:
            out.append((k, nxt))
    return out
