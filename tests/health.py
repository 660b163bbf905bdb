"""Waiting for a server started as a child process: poll its health URL until 200, the child exits or time runs out."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, describe: Callable[[], str]) -> None:
    """Returns once GET url answers 200; raises RuntimeError with describe() (e.g. the log's tail) otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{url} did not come up: {describe()}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, sig: int, timeout_s: float) -> None:
    """Send sig (the stop under test: SIGINT, SIGTERM), then kill the child if it has not exited after timeout_s."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
