"""bench/eplb_early_drift.py: the statistic per trace, ~1 on an unchanged router and far above it under fast drift,
by either halving of the newest tokens (its formulas: tests/analysis/test_eplb_early_drift.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.eplb_early_drift import measure, ranges
from bench.eplb_traces import TraceSpec


@pytest.mark.parametrize("drift, lo, hi", [("none", 0.5, 2.0), ("fast", 8.0, np.inf)])
def test_an_unchanged_router_sits_at_noise_and_fast_drift_far_above(drift, lo, hi):
    spec = TraceSpec(family="independent", drift=drift, zipf_s=0.6, num_layers=2, windows=4, window_tokens=4096)
    row = measure(spec, demix=False)
    for t in ("t2", "t3"):
        for x in row[t]["raw"]:  # alternate tokens, alternate blocks
            assert lo < x < hi, (drift, t, row[t])
    span = ranges([row])["independent/" + drift]
    assert span["t2 raw blocks"] == [row["t2"]["raw"][1]] * 2
