"""`r3trace dashboard` owns its Streamlit server: SIGTERM, SIGINT and SIGKILL of the command each leave its port
free and no process of it behind (it has no child processes to orphan), checked through /proc and a connect.
The three commands run side by side.

Run: .venv/bin/pytest -q tests/dashboard/test_process.py
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.dashboard.conftest import Store
from tests.dashboard.server import Dashboard, alive, children, port_is_free

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)


def test_stopping_the_command_stops_the_server(store: Store, tmp_path: Path) -> None:
    running = {sig: Dashboard(store.path, tmp_path / f"{sig.name}.log") for sig in SIGNALS}
    try:
        for d in running.values():
            d.wait_healthy()
        kids = {sig: children(d.pid) for sig, d in running.items()}
        for sig, d in running.items():
            assert not kids[sig], f"r3trace dashboard started child processes {kids[sig]}: they could outlive it"
            d.proc.send_signal(sig)
        for sig, d in running.items():
            d.proc.wait(timeout=15)
            deadline = time.monotonic() + 5
            while not port_is_free(d.port) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert port_is_free(d.port), f"port {d.port} still answers after {sig.name}"
            assert not any(alive(p) for p in [d.pid, *kids[sig]]), sig.name
    finally:
        Dashboard.stop_all(list(running.values()), kill=True)
