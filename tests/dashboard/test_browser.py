"""The running dashboard in headless chromium: the title and a rendered Plotly chart are in the DOM;
a screenshot is saved under the test's tmp folder (its path is printed).

Needs Debian's chromium: installed by tests/dashboard/ensure_chromium.sh (run here when it is missing);
skipped, saying so, only when it cannot be installed.
Run: .venv/bin/python -m pytest -q -s tests/dashboard/test_browser.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from r3trace.commands.dashboard import streamlit_command
from tests.dashboard.browser import CHROMIUM, Browser
from tests.dashboard.conftest import Store

ENSURE = Path(__file__).with_name("ensure_chromium.sh")


def free_port() -> int:
    with socket.socket() as s:  # streamlit cannot take port 0; a just-freed loopback port is near certain
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        subprocess.run(["bash", str(ENSURE)], check=False, timeout=600)
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} missing and {ENSURE.name} could not install it (needs root and apt-get)")
    return CHROMIUM


@pytest.fixture()
def dashboard(store: Store, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path / "streamlit.log", "wb")  # noqa: SIM115 (closed below, after the process)
    proc = subprocess.Popen(streamlit_command(str(store.path), "127.0.0.1", port), stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "R3TRACE_STORE": str(store.path)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/_stcore/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"streamlit did not come up: {(tmp_path / 'streamlit.log').read_text()[-2000:]}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_dashboard_renders_in_chromium(chromium: Path, dashboard: str, tmp_path: Path) -> None:
    browser = Browser(tmp_path / "profile")
    try:
        browser.call("Page.enable")
        browser.call("Page.navigate", url=f"{dashboard}/heat?run=base")
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
    finally:
        browser.close()
