"""bench/eplb_ours_loads.py: the matrix's ours plans on token_mix.planning_loads of the windows seen, and a fit read
back from the shared cache folder is the fit itself.

Run: .venv/bin/pytest tests/bench/test_eplb_ours_loads.py -q
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from bench.eplb_ours_loads import cache_path, main, ours_loads, spans, windows_of
from bench.eplb_traces import TraceSpec
from r3trace.eplb.score import heat_of
from r3trace.eplb.token_mix import planning_loads

SPEC = TraceSpec(family="grouped", drift="fast", num_layers=2, windows=5, window_tokens=512, seed=3)


def test_ours_loads_are_planning_loads_and_the_cache_keeps_them(tmp_path: Path) -> None:
    routes = windows_of(SPEC)[0]
    direct = planning_loads(np.stack([heat_of(w, SPEC.num_experts) for w in routes[1:4]]), list(routes[1:4]))
    ours_loads.cache_clear()
    first = ours_loads(SPEC, 1, 4, tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    ours_loads.cache_clear()
    again = ours_loads(SPEC, 1, 4, tmp_path)  # read from the folder: no fit
    for got in (first, again):
        assert got.name == direct.name and got.errors == direct.errors and got.aic == direct.aic
        np.testing.assert_array_equal(got.loads, direct.loads)
    assert ours_loads(SPEC, 0, 4, tmp_path).loads.shape[0] == 4  # another span: another entry
    assert len(list(tmp_path.iterdir())) == 2


def test_main_fits_every_span_a_matrix_cell_plans_from(tmp_path: Path) -> None:
    """The precompute fits what run_cell asks ours_loads for, t = 1 .. W - 2 on the newest HISTORY windows up to t,
    of the cells whose planners see tokens (an SGLang dump's do not), each span once, and nothing else."""
    dump = replace(SPEC, family="sglang-dump")
    results = tmp_path / "eplb-matrix-x.json"
    results.write_text(json.dumps({"results": [{"spec": asdict(s)} for s in (SPEC, SPEC, dump)]}))
    assert spans(5) == [(0, 2), (0, 3), (0, 4)] and spans(12)[-1] == (3, 11)
    cache = tmp_path / "cache"
    main(["--mix-cache", str(cache), "--jobs", "1", str(results)])
    assert sorted(cache.iterdir()) == sorted(cache_path(SPEC, lo, hi, cache) for lo, hi in spans(5))
    routes = windows_of(SPEC)[0]
    for lo, hi in spans(5):
        doc = json.loads(cache_path(SPEC, lo, hi, cache).read_text())
        direct = planning_loads(np.stack([heat_of(w, SPEC.num_experts) for w in routes[lo:hi]]), list(routes[lo:hi]))
        assert doc["name"] == direct.name
        np.testing.assert_array_equal(np.array(doc["loads"]), direct.loads)


def test_a_three_window_fit_keeps_its_demixed_windows_and_a_stale_one_is_fitted_again(tmp_path: Path) -> None:
    """Source.demixed (the early drift test's windows) round-trips through the cache on a three-window span, and a doc
    cached without it there (before it existed) is fitted again rather than read as None."""
    routes = windows_of(SPEC)[0]
    direct = planning_loads(np.stack([heat_of(w, SPEC.num_experts) for w in routes[1:4]]), list(routes[1:4]))
    assert direct.demixed is not None and direct.demixed.shape == direct.loads.shape
    ours_loads.cache_clear()
    path = cache_path(SPEC, 1, 4, tmp_path)
    path.write_text(json.dumps({"loads": direct.loads.tolist(), "name": direct.name, "errors": direct.errors,
                                "aic": {str(k): v for k, v in direct.aic.items()}}))  # as cached before
    got = ours_loads(SPEC, 1, 4, tmp_path)
    assert got.demixed is not None
    np.testing.assert_array_equal(got.demixed, direct.demixed)
    assert json.loads(path.read_text())["demixed"] == direct.demixed.tolist()  # written back
    ours_loads.cache_clear()
    np.testing.assert_array_equal(ours_loads(SPEC, 1, 4, tmp_path).demixed, direct.demixed)
    ours_loads.cache_clear()
    assert ours_loads(SPEC, 0, 4, tmp_path).demixed is None  # four windows: the backtest's own drift test
