"""Results of a parallel layout against the one-process run of the same workload (bench/multigpu/workload.py).

Exact mode (deterministic=True) promises the same bits in any layout, so ExactDiff compares with ==: greedy
tokens, input and output logprobs (top-2 too), routes ((token, layer) entries) and their weights. Default mode sums
in other orders, so DefaultDiff asks for the same greedy tokens, logprobs within LOGPROB_ATOL, and routes equal
away from near-ties (engine/near_tie.py: an entry whose order gap in a one-process forward is under the threshold
may flip, and the flips are counted).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.multigpu.workload import LISTS, PROMPTS, Results, routes_of, weights_of
from r3trace.engine.near_tie import FlipCount, count_flips

LOGPROB_ATOL = 1e-4  # fp32: another summation order moves logprobs by ~1e-6; a missing or doubled reduction by ~1
NEAR_TIE = 1e-5  # fp32: order-gap below which another summation order may swap two experts (~1e-6 moves)


@dataclass
class ExactDiff:
    """Bitwise comparison of results: tokens, input and output logprobs (== on floats; top-2 too), routes and their
    weights. Counts are of requests (tokens), entries (logprobs) and (token, layer) entries (routes)."""

    requests: int = 0
    token_mismatches: int = 0
    logprob_mismatches: int = 0
    route_entries: int = 0
    route_mismatches: int = 0
    weight_mismatches: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems

    def add(self, case: str, want: dict[str, Any], got: dict[str, Any]) -> None:
        self.requests += 1
        if got["output_ids"] != want["output_ids"]:
            self.token_mismatches += 1
            self.problems.append(f"{case}: output ids differ: {got['output_ids']} vs {want['output_ids']}")
        for key in LISTS:
            w, g = want["meta_info"][key], got["meta_info"][key]
            if len(g) != len(w) or (key in LISTS[:2] and not w):
                self.logprob_mismatches += max(len(g), len(w), 1)
                self.problems.append(f"{case} {key}: {len(g)} entries, want {len(w)} > 0")
                continue
            bad = [i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b]
            if bad:
                self.logprob_mismatches += len(bad)
                self.problems.append(f"{case} {key}: {len(bad)} of {len(w)} differ, first at {bad[0]}: "
                                     f"{w[bad[0]]} vs {g[bad[0]]}")  # fmt: skip
        a, b = routes_of(want), routes_of(got)
        if a.shape != b.shape:
            self.route_mismatches += max(a.shape[0] * a.shape[1], b.shape[0] * b.shape[1])
            self.problems.append(f"{case}: routes {b.shape}, want {a.shape}")
            return
        self.route_entries += int((a[..., 0] >= 0).sum())
        mismatched = int((a != b).any(axis=-1).sum())
        if mismatched:
            self.route_mismatches += mismatched
            self.problems.append(f"{case}: {mismatched} of {a.shape[0] * a.shape[1]} (token, layer) route entries "
                                 "differ")  # fmt: skip
        w, g = weights_of(want), weights_of(got)
        if w.shape != a.shape or not np.array_equal(w, g, equal_nan=True):
            self.weight_mismatches += 1
            self.problems.append(f"{case}: routed weights differ")


def exact_diff(want: Results, got: Results) -> ExactDiff:
    """Every case's results against the reference's, request by request."""
    diff = ExactDiff()
    for case, outs in want.items():
        if len(got.get(case, [])) != len(outs):
            diff.problems.append(f"{case}: {len(got.get(case, []))} results, want {len(outs)}")
            continue
        for i, (w, g) in enumerate(zip(outs, got[case], strict=True)):
            diff.add(f"{case}[{i}]", w, g)
    return diff


@dataclass
class DefaultDiff:
    """Default mode against the one-process default run: requests whose tokens differ, the largest logprob
    difference, and the routes' near-tie counts (FlipCount.far: entries that differ away from any near-tie)."""

    requests: int = 0
    token_mismatches: int = 0
    max_logprob_diff: float = 0.0
    flips: FlipCount = field(default_factory=FlipCount)
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems


def _logprob_diff(want: list[Any], got: list[Any]) -> float:
    """Largest |difference| of two logprob lists ([logprob, token id, ...] entries; None where there is none)."""
    pairs = [(w[0], g[0]) for w, g in zip(want, got, strict=True) if w[0] is not None and g[0] is not None]
    return max((abs(a - b) for a, b in pairs), default=0.0)


def default_diff(want: Results, got: Results, gaps: Callable[[list[int]], np.ndarray], threshold: float = NEAR_TIE,
                 logprob_atol: float = LOGPROB_ATOL) -> DefaultDiff:
    """gaps(token_ids) -> [T, L] order gaps of a one-process forward (near_tie.sequence_gaps on the reference model).
    A request whose tokens differ is counted and its routes are not compared (its sequence diverged)."""
    diff = DefaultDiff()
    for case, outs in want.items():
        for i, (w, g) in enumerate(zip(outs, got.get(case, []), strict=False)):
            name = f"{case}[{i}]"
            diff.requests += 1
            if g["output_ids"] != w["output_ids"]:
                diff.token_mismatches += 1
                diff.problems.append(f"{name}: output ids differ: {g['output_ids']} vs {w['output_ids']}")
                continue
            for key in LISTS[:2]:
                if len(g["meta_info"][key]) != len(w["meta_info"][key]):
                    diff.problems.append(f"{name} {key}: {len(g['meta_info'][key])} entries, want "
                                         f"{len(w['meta_info'][key])}")  # fmt: skip
                    continue
                worst = _logprob_diff(w["meta_info"][key], g["meta_info"][key])
                diff.max_logprob_diff = max(diff.max_logprob_diff, worst)
                if worst > logprob_atol:
                    diff.problems.append(f"{name} {key}: differs by {worst:.2e} > {logprob_atol:g}")
            a, b = routes_of(w), routes_of(g)
            if a.shape != b.shape:
                diff.problems.append(f"{name}: routes {b.shape}, want {a.shape}")
                continue
            seq = (PROMPTS[case][i] + w["output_ids"])[: a.shape[0]]
            count = count_flips(a, b, gaps(seq), threshold)
            diff.flips += count
            if count.far:
                diff.problems.append(f"{name}: {count.far} (token, layer) route entries differ away from near-ties")
        if len(got.get(case, [])) != len(outs):
            diff.problems.append(f"{case}: {len(got.get(case, []))} results, want {len(outs)}")
    return diff
