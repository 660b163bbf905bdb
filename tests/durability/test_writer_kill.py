"""The durability contract of TraceWriter under SIGKILL, SIGTERM and SIGINT at random moments (seeded).

Each case draws its own file size, flush interval, compaction fan-in, request mix and stop time from its seed
(kill_harness.KillCase.draw), records in a child process, stops it, and checks: listed files whole; every
request that finished more than flush_interval_s before a kill (any request, for a graceful stop) committed
with every row and the exact ids; rows of unfinished requests visible only with their request marked
unfinished; recovery leaves exactly the listed files. `make test` runs a few seeds; `-m slow` runs many.
Run: .venv/bin/pytest tests/durability -q
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.durability.kill_harness import KillCase, run_case

QUICK = [(1, signal.SIGKILL), (2, signal.SIGKILL), (3, signal.SIGKILL), (4, signal.SIGTERM), (5, signal.SIGINT)]
MANY = [(s, signal.SIGKILL) for s in range(100, 140)] + [(s, sig) for s in range(200, 210)
                                                          for sig in (signal.SIGTERM, signal.SIGINT)]


@pytest.mark.parametrize(("seed", "sig"), QUICK)
def test_stop_at_random_point(seed: int, sig: int, tmp_path: Path) -> None:
    seen = run_case(KillCase.draw(seed, sig), tmp_path)
    assert seen["finished"] > 0  # the child got going before the stop: the case tested something


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "sig"), MANY)
def test_stop_at_random_point_many(seed: int, sig: int, tmp_path: Path) -> None:
    seen = run_case(KillCase.draw(seed, sig), tmp_path)
    assert seen["finished"] > 0
