"""Spawning rank processes from a bench script or a test (torch.multiprocessing, start method spawn).

Shared by bench/collective_bytes.py and the engine, server, durability and dashboard tests; it lives in bench/
because bench scripts must not depend on tests/ (tests may import bench).

A spawned child first re-runs the parent's `__main__`; Streamlit's AppTest (tests/dashboard) leaves
dashboards/app.py there, which fails on pytest's argv. The ranks need only the module that defines their
function: they start from a blank `__main__`, and the real one is put back once they have started.
"""

from __future__ import annotations

import socket
import sys
import types
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """fn(rank, *args) in nprocs processes; a rank that fails terminates the others (no hang in a collective)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        ranks = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    finally:
        sys.modules["__main__"] = main
    while not ranks.join():
        pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: a rank rendezvous (tcp:// init) or a test server's --port (Streamlit cannot
    take port 0; a loopback port just freed is near certain to stay free until the server binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
