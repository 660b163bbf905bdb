"""The running dashboard (`r3trace dashboard STORE`, a real process) in headless chromium: the title and a
rendered Plotly chart are in the DOM, a screenshot is saved under the test's tmp folder (its path is
printed), and each page's own URL opens directly (the default page too: /overview was "Page not found").

Needs Debian's chromium: installed by tests/dashboard/ensure_chromium.sh (run here when it is missing);
skipped, saying so, only when it cannot be installed.
Run: .venv/bin/pytest -q -s tests/dashboard/test_browser.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dashboard.browser import Browser
from tests.dashboard.server import Dashboard


def test_dashboard_renders_in_chromium(browser: Browser, dashboard: Dashboard, tmp_path: Path) -> None:
    browser.call("Page.navigate", url=f"{dashboard.url}/heat?run=base")
    plots = browser.wait_for("document.querySelectorAll('.js-plotly-plot .main-svg').length", 90)
    assert plots and plots >= 1, "no Plotly chart rendered within 90 s"
    assert browser.evaluate("document.title") == "r3trace"
    h1 = browser.evaluate("Array.from(document.querySelectorAll('h1')).map(e => e.innerText).join('|')")
    assert "r3trace: MoE routing traces" in h1
    heat = browser.evaluate("document.querySelectorAll('.js-plotly-plot .heatmaplayer, "
                            ".js-plotly-plot image, .js-plotly-plot .hm').length")
    assert heat >= 1, "the heat map trace is not in the chart's DOM"
    shot = tmp_path / "dashboard-heat.png"
    browser.screenshot(shot)
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


@pytest.mark.parametrize(("path", "heading"), [
    ("/overview?run=flip", "Overview of flip"), ("/?run=flip", "Overview of flip"),
    ("/sql?q=SELECT+count(*)+AS+n+FROM+runs", "SQL console (read-only)")])
def test_page_urls_open_directly(browser: Browser, dashboard: Dashboard, path: str, heading: str) -> None:
    text = browser.open_page(dashboard.url + path, heading)
    assert text, f"{path}: {heading!r} not shown: {browser.evaluate('document.body.innerText')!r}"
    assert "Page not found" not in text
    want = "/sql" if path.startswith("/sql") else "/overview"  # the root forwards to /overview
    assert browser.evaluate("location.pathname") == want
    assert "run=flip" in browser.evaluate("location.search") or want == "/sql"  # the query string survives
