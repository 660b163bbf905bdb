"""`r3trace dashboard STORE` as a real process for the browser tests: started on a free loopback port, polled
until Streamlit's health endpoint answers, stopped with SIGTERM (SIGKILL after 15 s). Also the /proc
readings the tests use: a process's CPU seconds, its children, whether a port is free."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.spawn import free_port
from tests.health import wait_healthy

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (/proc/PID/stat fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def children(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{pid}\n" in status.read_text():
                out.append(int(status.parent.name))
        except OSError:  # the process ended while we looked
            pass
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Dashboard:
    """One `python -m r3trace.cli dashboard STORE --port P [extra]` process; `log` collects its output."""

    def __init__(self, store: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "r3trace.cli", "dashboard", str(store), "--port", str(self.port), *extra],
                stdout=out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_healthy(self, timeout_s: float = 60) -> None:
        wait_healthy(f"{self.url}/_stcore/health", self.proc, timeout_s, lambda: self.log.read_text()[-2000:])

    def stop(self) -> None:
        Dashboard.stop_all([self])

    @staticmethod
    def stop_all(dashboards: list[Dashboard], kill: bool = False) -> None:
        """SIGTERM (a graceful stop: 1.6 s measured) or SIGKILL (clean too: no child processes, see
        test_process.py) to all first, then wait for each."""
        for d in dashboards:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        for d in dashboards:
            try:
                d.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()

    def wait_idle(self, window_s: float = 0.25, below_s: float = 0.03, timeout_s: float = 30) -> float:
        """Seconds until the server burns < `below_s` CPU in a `window_s` window (at least one window)."""
        start = time.monotonic()
        while True:
            before = cpu_s(self.pid)
            time.sleep(window_s)
            if cpu_s(self.pid) - before < below_s or time.monotonic() - start > timeout_s:
                return time.monotonic() - start
