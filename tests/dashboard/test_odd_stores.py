"""Every page, opened by its own URL in headless chromium, on each store of odd_stores.py (empty, 0-row run,
crashed run, foreign entries): it shows the line that says what is missing, and no exception, no error
box, no "Page not found". One `r3trace dashboard` process per store, started together.

Run: .venv/bin/pytest -q tests/dashboard/test_odd_stores.py
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from dashboards.store_health import uncommitted_files
from r3trace.analysis.store import TraceStore
from r3trace.trace import open_dataset, recover_run
from tests.dashboard.browser import Browser
from tests.dashboard.odd_stores import KINDS, write_stores
from tests.dashboard.server import Dashboard

PAGES = ("overview", "heat", "imbalance", "coactivation", "requests", "diff", "eplb", "sql")
NO_ROUTES = "Run zero has no route rows: its manifest lists 0 file(s) and 0 rows."
NO_ROLLUPS = "Run zero has no rollup rows"
CRASHED = "Run crashed was not closed: its writer stopped without closing it (killed or crashed)"
# the crashed run as written (odd_stores.write_crashed; test_crashed_store_holds_what_the_pages_say checks it):
# "open" in flight at the last commit, the unlisted copy and the torn .tmp beside the listed files
CRASH_DETAILS = ("1 request(s) in flight at the last commit (open) are shown as finish_reason 'unfinished'.",
                 "2 uncommitted file(s) its manifest does not list (part-00007.parquet, part-00008.parquet.tmp) "
                 "are not shown;")
RECOVER = "r3trace.trace.recover_run('{}') deletes them and closes the run."
# "done" (finish_reason 'stop') and "open" (no requests row in the files; 'unfinished' from the manifest)
CRASHED_REQUESTS = ("1 of 2 requests had not finished when the trace was written (1 with finish_reason "
                    "'unfinished': empty tag and lengths)")
FOREIGN = "Not runs, not shown: notes.csv, plots/, run_id=ghost/ (no manifest.json), stray.parquet"


def expected(kind: str, page: str, store: Path) -> list[str]:
    """Text the page must show (the first one is waited for); `store` is the kind's store folder."""
    if kind == "empty":
        return ["holds no r3trace runs: no run_id=*/manifest.json under it. The folder is empty."]
    if kind == "zero":
        return {"heat": [NO_ROLLUPS], "imbalance": [NO_ROLLUPS], "diff": ["The store holds one run (zero)"],
                "sql": ["0 rows"]}.get(page, [NO_ROUTES])
    if kind == "crashed":
        per_page = {"overview": "Overview of crashed", "heat": "Layer x expert heat", "imbalance":
                    "Imbalance over time", "coactivation": "Co-activation", "requests":
                    CRASHED_REQUESTS, "diff": "The store holds one run (crashed)",
                    "eplb": "Balancedness (replayed)", "sql": "3 rows"}  # sql: 3 MoE layers
        run_dir = store.resolve() / "run_id=crashed"
        return [per_page[page], CRASHED, *CRASH_DETAILS, RECOVER.format(run_dir)]
    per_page = {"overview": "Overview of fine", "heat": "Layer x expert heat", "imbalance": "Imbalance over time",
                "coactivation": "Co-activation", "requests": "Tokens with routes",
                "diff": "The store holds one run (fine)", "eplb": "Balancedness (replayed)", "sql": "3 rows"}
    return [per_page[page], FOREIGN]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_stores(tmp_path_factory.mktemp("odd") / "stores")


@pytest.fixture(scope="module")
def servers(stores: dict[str, Path]) -> Iterator[dict[str, Dashboard]]:
    base = stores["empty"].parent.parent
    running = {k: Dashboard(stores[k], base / f"{k}.log") for k in KINDS}
    try:
        for d in running.values():
            d.wait_healthy()
        yield running
    finally:
        Dashboard.stop_all(list(running.values()), kill=True)


@pytest.mark.parametrize("kind", KINDS)
def test_every_page_says_what_is_missing(
    kind: str, stores: dict[str, Path], servers: dict[str, Dashboard], browser: Browser
) -> None:
    tabs = {page: browser.open_tab(f"{servers[kind].url}/{page}") for page in PAGES}  # 8 sessions at once
    try:
        for page, (_, session) in tabs.items():
            want = expected(kind, page, stores[kind])
            text = str(browser.wait_for(browser.settled(want[0]), 60, session) or "")
            where = f"{kind} store, /{page}"
            assert text, f"{where}: {want[0]!r} not shown: {browser.evaluate('document.body.innerText', session)!r}"
            for line in want[1:]:
                assert line in text, f"{where}: {line!r} missing"
            if kind != "crashed":
                assert "was not closed" not in text and "is recording" not in text, f"{where}: {text!r}"
            assert "Traceback" not in text and "Page not found" not in text, f"{where}: {text!r}"
            assert browser.count("[data-testid=stException]", session) == 0, f"{where}: an exception is shown"
            assert browser.count("[data-testid=stAlertContentError]", session) == 0, f"{where}: an error box"
            assert browser.evaluate("location.pathname", session) == f"/{page}", where
    finally:
        for target, _ in tabs.values():
            browser.close_tab(target)


def test_crashed_store_holds_what_the_pages_say(stores: dict[str, Path], tmp_path: Path) -> None:
    """The numbers and names of CRASH_DETAILS and CRASHED_REQUESTS, read from the store itself; and recover_run
    deletes exactly the files the warning names, keeping every committed row."""
    [run] = open_dataset(stores["crashed"])
    assert run.state == "crashed"
    assert run.manifest.open_requests == ("open",)
    assert [f.name for f in run.manifest.files] == ["part-00000.parquet"]
    def files(root: Path) -> list[str]:  # the run's files, in its manifest folder and its table folders
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    on_disk = files(stores["crashed"])
    assert on_disk == ["requests/run_id=crashed/requests-00000.parquet", "rollups/run_id=crashed/rollup-00000.parquet",
                       "routes/run_id=crashed/part-00000.parquet", "routes/run_id=crashed/part-00007.parquet",
                       "run_id=crashed/.writer.lock", "run_id=crashed/manifest.json",
                       "run_id=crashed/part-00008.parquet.tmp"]
    store = TraceStore(stores["crashed"])
    reqs = store.query("SELECT t.request_id, r.finish_reason FROM (SELECT DISTINCT request_id FROM tokens) t"
                       " LEFT JOIN requests r USING (request_id) ORDER BY 1")
    assert reqs.rows() == [("done", "stop"), ("open", "unfinished")]  # "later" was never committed
    tokens = store.query("SELECT count(*) FROM tokens").item()
    assert tokens == 5  # done 3 + open 2

    copy = tmp_path / "crashed"
    shutil.copytree(stores["crashed"], copy)
    m = recover_run(copy / "run_id=crashed")
    assert m.status == "closed" and m.open_requests == ()
    gone = set(on_disk) - set(files(copy))
    assert gone == {"routes/run_id=crashed/part-00007.parquet", "run_id=crashed/part-00008.parquet.tmp"}
    assert uncommitted_files(run) == sorted(Path(p).name for p in gone)  # the files the warning names
    [closed] = open_dataset(copy)
    assert closed.state == "closed"
    recovered = TraceStore(copy).query("SELECT request_id, finish_reason FROM requests ORDER BY 1")
    assert recovered.rows() == reqs.rows()
