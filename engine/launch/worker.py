"""rank_main: one rank of a multi-process engine, in a process the front end spawned (or torchrun started).

The rank joins the default process group (gloo on CPU, NCCL on CUDA, picked from EngineConfig.device),
builds its groups with init_parallel, a gloo group over the world for the host-side lockstep messages, its
EngineCore (the model shard, scheduler, KV pool, capturer), then runs RankLoop until shutdown.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from r3trace.engine.distributed import init_parallel
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.engine_core import EngineCore
from r3trace.engine.launch.config import LaunchConfig
from r3trace.engine.launch.lockstep import RankLoop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs, pickled to it at spawn."""

    model_path: Path
    config: EngineConfig
    launch: LaunchConfig
    init_method: str  # "file://..." (spawned ranks) or "env://" (torchrun)
    threads: int = 0  # torch intra-op threads per rank; 0 leaves torch's default
    # The front end's pid, set in the parent before it spawns (a child reading os.getppid() after the parent died
    # would read its new parent's). None: ranks torchrun started, whose parent is not the front end.
    parent_pid: int | None = None


PARENT_POLL_S = 0.5  # how often a starting rank checks that its front end is alive


def parent_gone(parent_pid: int) -> bool:
    """The front end that spawned this process has exited: a child whose parent dies is re-parented."""
    return os.getppid() != parent_pid


def exit_without_parent(rank: int, parent_pid: int, done: threading.Event, folder: Path) -> None:
    """Until `done` (the rank is in its loop, which checks the parent itself): exit the process with one line on
    stderr once the front end is gone, removing the rendezvous `folder` the dead front end would have.
    init_process_group waits for every rank and the model load takes minutes; neither returns when the front end
    dies, so without this a rank would wait for its collective timeout or forever."""
    while not done.wait(PARENT_POLL_S):
        if parent_gone(parent_pid):
            print(f"r3trace rank {rank}: the front end (pid {parent_pid}) exited while the rank started",
                  file=sys.stderr, flush=True)  # fmt: skip
            shutil.rmtree(folder, ignore_errors=True)
            os._exit(1)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def join_world(spec: WorkerSpec, rank: int) -> Any:
    """init_process_group + init_parallel; -> (ParallelInfo, cpu_group)."""
    lc = spec.launch
    timeout = timedelta(seconds=lc.collective_timeout_s)
    backend = backend_for(spec.config.device)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method=spec.init_method, rank=rank, world_size=lc.tp_size,
                            timeout=timeout)
    parallel = init_parallel(lc.tp_size, lc.dp_size, lc.ep_size, timeout=timeout)
    # Host-side messages travel over gloo whatever the model's backend (init_parallel's cpu_group).
    return parallel, parallel.cpu_group


def run_rank(spec: WorkerSpec, rank: int, inbox: Any = None, to_front: Any = None, front_pid: int | None = None,
             started: threading.Event | None = None) -> None:
    """One rank from start to shutdown. The control rank (0) reports a failure to the front end before it
    re-raises; another rank's failure reaches it as a dead process (the front end's watchdog) or as an error in
    the control rank's next collective."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    try:
        parallel, cpu_group = join_world(spec, rank)
        core = EngineCore(spec.model_path, spec.config, parallel, threaded=False)
        if started is not None:
            started.set()  # from here RankLoop checks front_pid between steps
        RankLoop(core, parallel, cpu_group, inbox, to_front, front_pid).run()
    except BaseException as exc:
        log.error("rank %d failed:\n%s", rank, traceback.format_exc())
        if to_front is not None:
            to_front.put([("fatal", rank, f"rank {rank} failed: {exc!r}")])
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_main(rank: int, spec: WorkerSpec, inbox: Any, to_front: Any) -> None:
    """The target of each spawned process (torch.multiprocessing, start method spawn). spec.parent_pid is the front
    end's pid; while the rank starts, a watcher thread exits the process once the front end is gone."""
    parent = spec.parent_pid if spec.parent_pid is not None else os.getppid()
    started = threading.Event()
    folder = rendezvous_folder(spec.init_method)
    threading.Thread(target=exit_without_parent, args=(rank, parent, started, folder), name="r3trace-parent-watch",
                     daemon=True).start()  # fmt: skip
    try:
        run_rank(spec, rank, inbox if rank == 0 else None, to_front if rank == 0 else None, parent, started)
    finally:
        if parent_gone(parent):  # the front end, which removes the rendezvous folder on shutdown, was killed
            shutil.rmtree(folder, ignore_errors=True)


def rendezvous_folder(init_method: str) -> Path:
    """The folder of a file:// rendezvous (WorkerGroup.spawn's mkdtemp)."""
    return Path(init_method.removeprefix("file://")).parent
