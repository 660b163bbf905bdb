"""The loads the held-out matrix's ours plans on (bench/eplb_matrix.py): token_mix.planning_loads of the windows seen,
as `r3trace eplb` hands them to ours, fitted once a trace and history span for every cell and policy that reads them.

Shape legend: W windows, T tokens, L layers, E experts, K top-k.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import numpy as np

from bench.eplb_traces import TraceSpec, load_windows
from r3trace.eplb.score import heat_of
from r3trace.eplb.token_mix import Source, planning_loads


@lru_cache(maxsize=8)
def windows_of(spec: TraceSpec) -> tuple[np.ndarray, bool]:
    """load_windows, generated once for the cells of a sweep that share a trace (read only)."""
    return load_windows(spec)


@lru_cache(maxsize=256)
def ours_loads(spec: TraceSpec, lo: int, hi: int, cache: Path | None = None) -> Source:
    """The loads ours plans on at the end of window hi - 1 from windows lo .. hi - 1 (token_mix.planning_loads),
    fitted once for every cell and policy of ours on this trace (cells of a sweep share traces); cache: a folder
    where runs of other sweeps' files (separate processes) find each other's fits."""
    path = None
    if cache is not None:
        key = hashlib.sha256(json.dumps([asdict(spec), lo, hi], sort_keys=True).encode()).hexdigest()[:24]
        path = cache / f"{key}.json"
        if path.exists():
            doc = json.loads(path.read_text())
            return Source(np.array(doc["loads"]), doc["name"], doc["errors"],
                          {int(k): v for k, v in doc["aic"].items()})
    routes = windows_of(spec)[0]
    src = planning_loads(np.stack([heat_of(w, spec.num_experts) for w in routes[lo:hi]]), list(routes[lo:hi]))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"loads": src.loads.tolist(), "name": src.name, "errors": src.errors,
                                   "aic": {str(k): v for k, v in src.aic.items()}}))
        tmp.replace(path)
    return src
