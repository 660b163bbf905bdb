"""Headless Debian chromium driven over the DevTools protocol (a websocket), for the dashboard test.

Started with a fresh --user-data-dir and --remote-debugging-port=0; the port chromium picked is read
from the DevToolsActivePort file it writes there, so no port is guessed.
"""

from __future__ import annotations

import base64
import itertools
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import websocket

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--disable-default-apps", "--window-size=1400,1000", "--remote-debugging-address=127.0.0.1",
         "--remote-debugging-port=0"]


class Browser:
    def __init__(self, profile: Path) -> None:
        self.proc = subprocess.Popen([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port within 30 s")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=30,
                                              suppress_origin=True)
        self._ids = itertools.count(1)

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """One DevTools command; `session` (from open_tab) sends it to another tab over this connection."""
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params}
        if session is not None:
            msg["sessionId"] = session
        self.ws.send(json.dumps(msg))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def evaluate(self, expression: str, session: str | None = None) -> Any:
        out = self.call("Runtime.evaluate", session, expression=expression, returnByValue=True)
        return out["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float, session: str | None = None) -> Any:
        """Polls a JS expression until it is truthy; returns its last value."""
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression, session)
            if value:
                return value
            time.sleep(0.1)
        return value

    @staticmethod
    def settled(expect: str) -> str:
        """JS: the page's text once its script run has finished, nothing is still loading and `expect` is
        shown; else ""."""
        return (f"document.body && document.body.innerText.includes({json.dumps(expect)})"
                " && document.querySelector('[data-testid=stApp]')?.dataset.testScriptState === 'notRunning'"
                " && !document.querySelector('[data-testid=stSkeleton]') ? document.body.innerText : ''")

    def open_page(self, url: str, expect: str, timeout_s: float = 30) -> str:
        """Navigates this tab to `url` (a fresh Streamlit session); waits for `settled(expect)` and returns
        the page's text ("" on timeout)."""
        self.evaluate("window.__r3trace_old_page = true")
        self.call("Page.navigate", url=url)
        return str(self.wait_for(f"window.__r3trace_old_page === undefined && ({self.settled(expect)})",
                                 timeout_s) or "")

    def count(self, selector: str, session: str | None = None) -> int:
        return int(self.evaluate(f"document.querySelectorAll({json.dumps(selector)}).length", session))

    def open_tab(self, url: str) -> tuple[str, str]:
        """A new tab on `url` (its own Streamlit session): (target id for close_tab, session for call)."""
        target = str(self.call("Target.createTarget", url=url)["targetId"])
        return target, str(self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"])

    def close_tab(self, target: str) -> None:
        self.call("Target.closeTarget", targetId=target)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
