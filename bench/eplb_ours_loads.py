"""The loads the held-out matrix's ours plans on (bench/eplb_matrix.py): token_mix.planning_loads of the windows seen,
as `r3trace eplb` hands them to ours, fitted once a trace and history span for every cell and policy that reads them.

Run: .venv/bin/python -m bench.eplb_ours_loads --mix-cache DIR --jobs N [FILE ...]
     fits every span the matrix's ours reads for the cells of the result files (default: every held-out one) into
     DIR, N processes at a time; then bench/eplb_matrix.py --mix-cache DIR reads them instead of fitting
     (--smoke: one small trace, a temporary folder).

Shape legend: W windows, T tokens, L layers, E experts, K top-k.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import numpy as np

from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb import Cluster, plan
from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.early_drift import EARLY_WINDOWS
from r3trace.eplb.placement import Placement
from r3trace.eplb.score import heat_of
from r3trace.eplb.token_mix import Source, planning_loads

HISTORY = 8  # windows a matrix policy plans from (bench/eplb_matrix.py run_cell)
RESULTS = Path(__file__).resolve().parent / "results"


@lru_cache(maxsize=8)
def windows_of(spec: TraceSpec) -> tuple[np.ndarray, bool]:
    """load_windows, generated once for the cells of a sweep that share a trace (read only)."""
    return load_windows(spec)


@lru_cache(maxsize=256)
def ours_loads(spec: TraceSpec, lo: int, hi: int, cache: Path | None = None, tokens: int | None = None) -> Source:
    """The loads ours plans on at the end of window hi - 1 from windows lo .. hi - 1 (token_mix.planning_loads),
    fitted once for every cell and policy of ours on this trace (cells of a sweep share traces); cache: a folder
    where runs of other sweeps' files (separate processes) find each other's fits. tokens: fit on each window's
    first `tokens` routes (`r3trace eplb --mix-tokens`; the heat stays the whole window's), None: all of them."""
    path = None if cache is None else cache_path(spec, lo, hi, cache, tokens)
    doc = json.loads(path.read_text()) if path is not None and path.exists() else None
    # histories of <= EARLY_WINDOWS windows read Source.demixed, which every fit sets there: one cached without it
    # (before it existed, or None where the fit found one kind) is fitted again
    if doc is not None and (doc.get("demixed") is not None or hi - lo > EARLY_WINDOWS):
        demixed = None if doc.get("demixed") is None else np.array(doc["demixed"])
        return Source(np.array(doc["loads"]), doc["name"], doc["errors"], {int(k): v for k, v in doc["aic"].items()},
                      demixed)
    routes = windows_of(spec)[0][lo:hi]
    src = planning_loads(np.stack([heat_of(w, spec.num_experts) for w in routes]), [w[:tokens] for w in routes])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"loads": src.loads.tolist(), "name": src.name, "errors": src.errors,
                                   "aic": {str(k): v for k, v in src.aic.items()},
                                   "demixed": None if src.demixed is None else src.demixed.tolist()}))
        tmp.replace(path)
    return src


# (windows seen [W, L, E], the policy's previous placement, the newest tokens, what ours plans on: ours_loads' Source,
# None without tokens) -> a placement: a policy of bench/eplb_matrix.py's cells
Policy = Callable[[np.ndarray, Placement | None, np.ndarray | None, Source | None], Placement]


def ours_policy(cluster: Cluster, cfg: PlannerConfig = PlannerConfig()) -> Policy:
    """Ours as `r3trace eplb` plans it on the cluster: (windows seen [W, L, E], its previous placement, the newest
    tokens, what ours_loads gave (None without tokens)) -> a placement, the Source's mixed and demixed windows
    handed to plan()."""
    def ours(h: np.ndarray, prev: Placement | None, tokens: np.ndarray | None, src: Source | None) -> Placement:
        return plan(h, cluster, prev, tokens=tokens, cfg=cfg, mixed=None if src is None else src.mixed,
                    demixed=None if src is None else src.demixed)
    return ours


def cache_path(spec: TraceSpec, lo: int, hi: int, cache: Path, tokens: int | None = None) -> Path:
    """The file in `cache` holding ours_loads(spec, lo, hi, tokens=tokens) (all tokens: the key without them)."""
    fields = [asdict(spec), lo, hi] + ([] if tokens is None else [tokens])
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
    return cache / f"{key}.json"


def spans(windows: int, history: int = HISTORY) -> list[tuple[int, int]]:
    """-> the (lo, hi) history spans a matrix cell of `windows` windows plans from, t = 1 .. windows - 2."""
    return [(max(0, t + 1 - history), t + 1) for t in range(1, windows - 1)]


def matrix_spans(files: list[Path]) -> Iterator[tuple[TraceSpec, int, int]]:
    """Every (spec, lo, hi) ours reads in the cells of these matrix result files (families whose planners see
    tokens), each once, spec by spec."""
    seen: set[tuple[TraceSpec, int, int]] = set()
    for f in files:
        for r in json.loads(f.read_text()).get("results", []):
            spec = TraceSpec(**r["spec"])
            if spec.family == "sglang-dump":
                continue
            for lo, hi in spans(spec.windows):
                if (spec, lo, hi) not in seen:
                    seen.add((spec, lo, hi))
                    yield spec, lo, hi


def _fit(job: tuple[TraceSpec, int, int, Path]) -> str:
    return ours_loads(*job).name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="matrix result files (default: bench/results/eplb-matrix-*.json)")
    ap.add_argument("--mix-cache", help="folder the fits are written to")
    ap.add_argument("--jobs", type=int, default=1, help="processes fitting at once")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="start no fit after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="one small trace's spans into a temporary folder: make test")
    args = ap.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            spec = TraceSpec(family="grouped", drift="fast", num_layers=2, windows=5, window_tokens=512)
            (Path(tmp) / "eplb-matrix-smoke.json").write_text(json.dumps({"results": [{"spec": asdict(spec)}]}))
            return main(["--mix-cache", str(Path(tmp) / "cache"), str(Path(tmp) / "eplb-matrix-smoke.json")])
    if args.mix_cache is None:
        ap.error("give --mix-cache DIR (or --smoke)")
    cache = Path(args.mix_cache)
    files = [Path(f) for f in args.files] or sorted(RESULTS.glob("eplb-matrix-*.json"))
    todo = [(s, lo, hi, cache) for s, lo, hi in matrix_spans(files) if not cache_path(s, lo, hi, cache).exists()]
    t0, done = time.perf_counter(), 0
    print(f"{len(todo)} spans to fit", flush=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        queue, running = iter(todo), set[Future[str]]()
        while True:
            while len(running) < args.jobs and time.perf_counter() - t0 < args.budget_s:
                job = next(queue, None)
                if job is None:
                    break
                running.add(pool.submit(_fit, job))
            if not running:
                break
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            done += len(finished)
            for f in finished:
                f.result()
    print(f"{done} of {len(todo)} fitted in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
