"""Trace windows for EPLB: the part of a trace a plan is trained on, the part it is scored on (held out), and
the history windows a forecast sees. Pure: the trace facts come in as RunFacts (loads.py reads them).

One syntax for `r3trace eplb --train/--eval` (docs/cli.md), a range is half-open [A, B), either end may be left
out (`time=600..` is everything from 600 s on, `forward=..5000` everything before forward 5000):

  time=A..B     seconds from the start of the run's first rollup window; read from the rollups, so A and B
                are multiples of the run's rollup window (1 s by default), and a plan never scans routes
  forward=A..B  forward ids; read from the routes (rollups keep no forward id)
  runs=a,b      whole runs, by run id, in start-time order

A window resolves to spans, its history windows oldest first: one time or forward range is cut into `windows`
equal parts (or parts of `window_s` seconds); several runs are one span each.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

WindowKind = Literal["time", "forward", "runs"]
KINDS: tuple[WindowKind, ...] = ("time", "forward", "runs")
NS = 1_000_000_000


@dataclass(frozen=True)
class WindowSpec:
    """What --train or --eval says: a range of seconds or forward ids, or named runs."""

    kind: WindowKind
    lo: float | None = None
    hi: float | None = None
    runs: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.kind == "runs":
            return "runs=" + ",".join(self.runs)
        unit = "s" if self.kind == "time" else ""
        ends = ["" if v is None else f"{v:g}{unit}" for v in (self.lo, self.hi)]
        return f"{self.kind}={ends[0]}..{ends[1]}"


def window_spec(text: str) -> WindowSpec:
    """argparse type of --train / --eval: 'time=A..B', 'forward=A..B' or 'runs=a,b' (argparse names the flag)."""
    kind, sep, rest = text.partition("=")
    if not sep or kind not in KINDS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected time=A..B (seconds), forward=A..B or runs=ID,ID")
    if kind == "runs":
        runs = tuple(r for r in rest.split(",") if r)
        if not runs:
            raise argparse.ArgumentTypeError(f"{text!r}: runs= needs at least one run id")
        return WindowSpec("runs", runs=runs)
    lo_text, dots, hi_text = rest.partition("..")
    if not dots:
        raise argparse.ArgumentTypeError(f"{text!r}: a range is A..B (either end may be left out)")
    ends = []
    for v in (lo_text, hi_text):
        v = v.strip().removesuffix("s") if kind == "time" else v.strip()
        try:
            ends.append(None if v == "" else (float(v) if kind == "time" else int(v)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {v!r} is not a number") from None
    lo, hi = ends
    if any(e is not None and (e < 0 or not math.isfinite(e)) for e in ends):
        raise argparse.ArgumentTypeError(f"{text!r}: ends must be >= 0")
    if lo is not None and hi is not None and hi <= lo:
        raise argparse.ArgumentTypeError(f"{text!r}: the range is empty (B <= A)")
    return WindowSpec(kind, lo, hi)  # type: ignore[arg-type]


class RunFacts(NamedTuple):
    """What resolving a window needs to know of one run (loads.run_facts reads it)."""

    run_id: str
    start_ns: int  # start of the first rollup window
    end_ns: int  # end of the last rollup window
    rollup_ns: int  # the run's rollup window
    forward_lo: int  # first forward id (0 when the run has no routes)
    forward_hi: int  # last forward id + 1
    has_routes: bool


class Span(NamedTuple):
    """One history window: rows of `run_id` with `field` in [lo, hi) (ns since the epoch, or forward ids)."""

    run_id: str
    field: Literal["ts", "forward_id"]
    lo: int
    hi: int


@dataclass(frozen=True)
class Selection:
    """A resolved window: its spans (history windows, oldest first) and how it reads in a report."""

    spec: WindowSpec
    spans: tuple[Span, ...]
    label: str

    @property
    def runs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.run_id for s in self.spans))


class WindowError(ValueError):
    """A window that does not fit the trace; the message names the flag, the window and the limit."""


def resolve(spec: WindowSpec, facts: dict[str, RunFacts], run_id: str | None, flag: str, windows: int = 8,
            window_s: float | None = None) -> Selection:
    """spec -> Selection over the trace. time and forward windows read run `run_id`; `windows` history parts
    (or parts of `window_s` seconds, time windows only)."""
    if spec.kind == "runs":
        missing = [r for r in spec.runs if r not in facts]
        if missing:
            raise WindowError(f"{flag} {spec}: no run {missing[0]} in the store (runs: {', '.join(facts)})")
        chosen = sorted((facts[r] for r in spec.runs), key=lambda f: f.start_ns)
        if len(chosen) == 1:
            return resolve(WindowSpec("time"), facts, chosen[0].run_id, flag, windows, window_s)
        spans = tuple(Span(f.run_id, "ts", f.start_ns, f.end_ns) for f in chosen)
        if window_s is not None:
            spans = tuple(s for f in chosen for s in _cut(f.run_id, "ts", f.start_ns, f.end_ns,
                                                          _width(window_s, f, flag, spec)))
        return Selection(spec, spans, describe(spans, facts))
    assert run_id is not None
    f = facts[run_id]
    if spec.kind == "time":
        lo = f.start_ns + _ns(spec.lo, f, flag, spec) if spec.lo is not None else f.start_ns
        hi = f.start_ns + _ns(spec.hi, f, flag, spec) if spec.hi is not None else f.end_ns
        hi = min(hi, f.end_ns)
        if lo >= hi:
            raise WindowError(f"{flag} {spec}: run {run_id} spans {(f.end_ns - f.start_ns) / NS:g} s; the window "
                              "holds none of it")
        if window_s is not None:
            spans = _cut(run_id, "ts", lo, hi, _width(window_s, f, flag, spec))
        else:
            spans = _parts(run_id, "ts", lo, hi, windows, f.rollup_ns)
        return Selection(spec, spans, describe(spans, facts))
    if not f.has_routes:
        raise WindowError(f"{flag} {spec}: run {run_id} holds heat only (no routes, so no forward ids); "
                          "use time= or runs=")
    if window_s is not None:
        raise WindowError(f"--window-s {window_s:g}: applies to time and runs windows; {flag} {spec} is cut "
                          "into --windows parts")
    lo = int(spec.lo) if spec.lo is not None else f.forward_lo
    hi = min(int(spec.hi), f.forward_hi) if spec.hi is not None else f.forward_hi
    if lo >= hi:
        raise WindowError(f"{flag} {spec}: run {run_id} holds forwards {f.forward_lo}..{f.forward_hi - 1}; "
                          "the window holds none of them")
    spans = _parts(run_id, "forward_id", lo, hi, windows, 1)
    return Selection(spec, spans, describe(spans, facts))


def later(train: Selection, facts: dict[str, RunFacts]) -> WindowSpec | None:
    """The held-out window by default: the rest of the trace after `train` (other runs that start after its
    last run, for runs= windows); None when nothing is left."""
    if train.spec.kind == "runs":
        last = max(facts[r].start_ns for r in train.runs)
        rest = tuple(r for r, f in sorted(facts.items(), key=lambda kv: kv[1].start_ns)
                     if r not in train.runs and f.start_ns > last)
        return WindowSpec("runs", runs=rest) if rest else None
    end = train.spans[-1]
    f = facts[end.run_id]
    if end.field == "ts":
        return WindowSpec("time", (end.hi - f.start_ns) / NS) if end.hi < f.end_ns else None
    return WindowSpec("forward", end.hi) if end.hi < f.forward_hi else None


def earlier(held_out: Selection, facts: dict[str, RunFacts]) -> WindowSpec:
    """The training window by default when only --eval is given: the trace before it."""
    first = held_out.spans[0]
    f = facts[first.run_id]
    if held_out.spec.kind == "runs":
        before = tuple(r for r, g in sorted(facts.items(), key=lambda kv: kv[1].start_ns)
                       if g.start_ns < f.start_ns and r not in held_out.runs)
        if not before:
            raise WindowError(f"--eval {held_out.spec}: no run starts before it to train on; give --train")
        return WindowSpec("runs", runs=before)
    if first.field == "ts":
        if first.lo <= f.start_ns:
            raise WindowError(f"--eval {held_out.spec}: starts where run {f.run_id} starts, nothing before it to "
                              "train on; give --train")
        return WindowSpec("time", None, (first.lo - f.start_ns) / NS)
    if first.lo <= f.forward_lo:
        raise WindowError(f"--eval {held_out.spec}: starts at the run's first forward; give --train")
    return WindowSpec("forward", None, first.lo)


def check_disjoint(train: Selection, held_out: Selection) -> None:
    """Held out means no shared row: refuse windows that overlap."""
    for a in train.spans:
        for b in held_out.spans:
            if a.run_id == b.run_id and a.field == b.field and a.lo < b.hi and b.lo < a.hi:
                raise WindowError(f"--eval {held_out.spec}: overlaps --train {train.spec}; a held-out window "
                                  "must not share rows with the training window")
            if a.run_id == b.run_id and a.field != b.field:
                raise WindowError(f"--eval {held_out.spec}: --train {train.spec} is of another kind on the same "
                                  "run; give both as time= or both as forward=")


def describe(spans: tuple[Span, ...], facts: dict[str, RunFacts]) -> str:
    """How a run of spans reads: 'time=0..6s of run a (3 windows)', 'forward=0..600 of run a', 'runs=a,b'."""
    runs = tuple(dict.fromkeys(s.run_id for s in spans))
    n = f" ({len(spans)} windows)" if len(spans) > 1 else ""
    if len(runs) > 1:
        return "runs=" + ",".join(runs) + n
    f, lo, hi = facts[runs[0]], spans[0].lo, spans[-1].hi
    if spans[0].field == "ts":
        return f"time={(lo - f.start_ns) / NS:g}..{(hi - f.start_ns) / NS:g}s of run {f.run_id}{n}"
    return f"forward={lo}..{hi} of run {f.run_id}{n}"


def _ns(seconds: float, f: RunFacts, flag: str, spec: WindowSpec) -> int:
    ns = round(seconds * NS)
    if ns % f.rollup_ns:
        raise WindowError(f"{flag} {spec}: {seconds:g} s is not a multiple of run {f.run_id}'s rollup window "
                          f"({f.rollup_ns / NS:g} s); time windows are read from the rollups")
    return ns


def _width(window_s: float, f: RunFacts, flag: str, spec: WindowSpec) -> int:
    ns = round(window_s * NS)
    if ns <= 0 or ns % f.rollup_ns:
        raise WindowError(f"--window-s {window_s:g}: must be a multiple of run {f.run_id}'s rollup window "
                          f"({f.rollup_ns / NS:g} s) for {flag} {spec}")
    return ns


def _parts(run_id: str, field: Literal["ts", "forward_id"], lo: int, hi: int, parts: int,
           unit: int) -> tuple[Span, ...]:
    """[lo, hi) cut into min(parts, units) near-equal parts of whole units (rollup windows or forwards)."""
    units = -(-(hi - lo) // unit)
    n = max(1, min(parts, units))
    bounds = [min(lo + (i * units // n) * unit, hi) for i in range(n)] + [hi]
    return tuple(Span(run_id, field, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def _cut(run_id: str, field: Literal["ts", "forward_id"], lo: int, hi: int, width: int) -> tuple[Span, ...]:
    return tuple(Span(run_id, field, a, min(a + width, hi)) for a in range(lo, hi, width))


def leading(f: RunFacts, share: float = 0.75) -> WindowSpec | None:
    """The first `share` of a run (by rollup windows, or by forwards when it spans one rollup window), so the rest
    is held out: the dashboard's default training window. None when the run cannot be split."""
    windows = (f.end_ns - f.start_ns) // f.rollup_ns
    if windows >= 2:
        return WindowSpec("time", None, min(max(int(windows * share), 1), windows - 1) * f.rollup_ns / NS)
    forwards = f.forward_hi - f.forward_lo
    if f.has_routes and forwards >= 2:
        return WindowSpec("forward", None, f.forward_lo + min(max(int(forwards * share), 1), forwards - 1))
    return None
