"""NVLink multicast off, in this process and in every process it starts.

NCCL's NVLS algorithms, torch's symmetric-memory multicast and NVSHMEM's NVLS all use NVLink SHARP multicast objects,
which the lent multi-GPU machines must not use (the device notes, KINDS.md). Set before torch is imported, the
three variables are in this process's C environment, which every rank the engine spawns (torch.multiprocessing,
start method spawn: a fork + exec with the parent's environment) inherits; `rank_environments` reads them back
from each rank process's /proc/<pid>/environ, so every case of the bench shows what its ranks really started with.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

MULTICAST_OFF: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast(environ: MutableMapping[str, str] = os.environ) -> dict[str, Any]:
    """Set MULTICAST_OFF in environ (overriding what was there); -> what was set and whether torch was already
    imported (it must not be: a library reads some of these when it loads)."""
    environ.update(MULTICAST_OFF)
    return {"set": dict(MULTICAST_OFF), "torch_imported_before": "torch" in sys.modules}


def process_environment(pid: int) -> dict[str, str]:
    """The environment a process started with (Linux /proc/<pid>/environ)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def rank_pids(engine: Any) -> list[int]:
    """The rank processes of a multi-process Engine (engine/launch/group.py's members); [] in one process."""
    members = getattr(getattr(engine, "_loop", None), "members", [])
    return [m.process.pid for m in members if getattr(m, "process", None) is not None]


def multicast_missing(engine: Any) -> list[str]:
    """'rank R: NAME=VALUE' for every rank process of engine whose environment lacks a MULTICAST_OFF setting;
    [] when every rank has all three."""
    missing = []
    for rank, pid in enumerate(rank_pids(engine)):
        env = process_environment(pid)
        missing += [f"rank {rank}: {k}={env.get(k)!r}, want {v!r}" for k, v in MULTICAST_OFF.items() if env.get(k) != v]
    return missing
