"""Every page, opened by its own URL in headless chromium, on each store of odd_stores.py (empty, 0-row run,
crashed run, foreign entries): it shows the line that says what is missing, and no exception, no error
box, no "Page not found". One `r3trace dashboard` process per store, started together.

Run: .venv/bin/python -m pytest -q tests/dashboard/test_odd_stores.py
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.dashboard.browser import Browser
from tests.dashboard.odd_stores import KINDS, write_stores
from tests.dashboard.server import Dashboard

PAGES = ("overview", "heat", "imbalance", "coactivation", "requests", "diff", "eplb", "sql")
NO_ROUTES = "Run zero has no route rows: its manifest lists 0 file(s) and 0 rows."
NO_ROLLUPS = "Run zero has no rollup rows"
CRASHED = "Run crashed was not closed cleanly"
# what the crashed run's warning names: the unlisted file, the torn one, "open" (no requests row), "cut"
CRASH_DETAILS = ("part-00001.parquet", "part-00002.parquet.tmp",
                 "1 of 3 requests with routes have no row in the requests table",
                 "1 request(s) marked finish_reason='unfinished'")
FOREIGN = "Not runs, not shown: notes.csv, plots/, run_id=ghost/ (no manifest.json), stray.parquet"


def expected(kind: str, page: str) -> list[str]:
    """Text the page must show (the first one is waited for)."""
    if kind == "empty":
        return ["holds no r3trace runs: no run_id=*/manifest.json under it. The folder is empty."]
    if kind == "zero":
        return {"heat": [NO_ROLLUPS], "imbalance": [NO_ROLLUPS], "diff": ["The store holds one run (zero)"],
                "sql": ["0 rows"]}.get(page, [NO_ROUTES])
    if kind == "crashed":
        per_page = {"overview": "Overview of crashed", "heat": "Layer x expert heat", "imbalance":
                    "Imbalance over time", "coactivation": "Co-activation", "requests":
                    "2 of 3 requests had not finished", "diff": "The store holds one run (crashed)",
                    "eplb": "Balancedness (replayed)", "sql": "3 rows"}  # sql: 3 MoE layers
        return [per_page[page], CRASHED, *CRASH_DETAILS]
    per_page = {"overview": "Overview of fine", "heat": "Layer x expert heat", "imbalance": "Imbalance over time",
                "coactivation": "Co-activation", "requests": "Tokens with routes",
                "diff": "The store holds one run (fine)", "eplb": "Balancedness (replayed)", "sql": "3 rows"}
    return [per_page[page], FOREIGN]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Dashboard]]:
    base = tmp_path_factory.mktemp("odd")
    stores = write_stores(base / "stores")
    running = {k: Dashboard(stores[k], base / f"{k}.log") for k in KINDS}
    try:
        for d in running.values():
            d.wait_healthy()
        yield running
    finally:
        Dashboard.stop_all(list(running.values()), kill=True)


@pytest.mark.parametrize("kind", KINDS)
def test_every_page_says_what_is_missing(kind: str, servers: dict[str, Dashboard], browser: Browser) -> None:
    tabs = {page: browser.open_tab(f"{servers[kind].url}/{page}") for page in PAGES}  # 8 sessions at once
    try:
        for page, (_, session) in tabs.items():
            want = expected(kind, page)
            text = str(browser.wait_for(browser.settled(want[0]), 60, session) or "")
            where = f"{kind} store, /{page}"
            assert text, f"{where}: {want[0]!r} not shown: {browser.evaluate('document.body.innerText', session)!r}"
            for line in want[1:]:
                assert line in text, f"{where}: {line!r} missing"
            assert "Traceback" not in text and "Page not found" not in text, f"{where}: {text!r}"
            assert browser.count("[data-testid=stException]", session) == 0, f"{where}: an exception is shown"
            assert browser.count("[data-testid=stAlertContentError]", session) == 0, f"{where}: an error box"
            assert browser.evaluate("location.pathname", session) == f"/{page}", where
    finally:
        for target, _ in tabs.values():
            browser.close_tab(target)
