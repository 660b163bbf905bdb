"""torchrun entry: `torchrun --nproc-per-node N -m r3trace.engine.launch MODEL [r3trace serve's flags]`.

Every process torchrun starts is one rank (RANK, WORLD_SIZE, LOCAL_RANK and the env:// rendezvous from
torchrun). World rank 0 also hosts the front end: it runs `r3trace serve` with launcher="torchrun", so its engine
drives rank 0's loop in a thread of the same process and the other ranks over the process group. --tp defaults
to WORLD_SIZE; any other value must equal it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from r3trace.cli import Parser
from r3trace.commands import serve
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.launch.config import LaunchConfig
from r3trace.engine.launch.worker import WorkerSpec, run_rank
from r3trace.errors import UsageError


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="torchrun ... -m r3trace.engine.launch")
    serve.add_arguments(parser)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UsageError("r3trace.engine.launch runs under torchrun (RANK and WORLD_SIZE unset); "
                         "one process: r3trace serve MODEL --tp N")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.tp_size == 1:
        args.tp_size = world
    if args.tp_size != world:
        raise UsageError(f"--tp {args.tp_size}: torchrun started {world} processes; "
                         f"give --nproc-per-node {args.tp_size}")
    args.launcher = "torchrun"
    if rank == 0:
        # uvicorn shuts the server down on SIGTERM, then re-raises the signal under the handler found at start:
        # SystemExit here (not the default, which kills the process) lets serve.run's engine.shutdown() stop the
        # other ranks between steps.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return serve.run(args)
    # torchrun (and Ctrl-C) signal every rank at once. Rank 0's server turns the signal into engine.shutdown(), which
    # tells this rank to stop between steps; stopping here first would break rank 0's collectives mid-step. If rank
    # 0 is gone instead, this rank's next collective fails and it exits; torchrun SIGKILLs after its grace period.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    opts = serve.launch_options(args)
    spec = WorkerSpec(Path(args.model), EngineConfig(**serve.engine_options(args)),  # type: ignore[arg-type]
                      LaunchConfig(**opts), "env://")  # type: ignore[arg-type]
    run_rank(spec, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
