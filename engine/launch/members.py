"""The ranks as the front end's watchdog sees them: alive or not, why they ended, how to stop them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

STOP_S = 10.0  # how long a rank may take to exit after shutdown (or after terminate) before it is killed


class Member(Protocol):
    """One rank as the front end sees it: a spawned process, or under torchrun the control rank's thread."""

    def is_alive(self) -> bool: ...

    def describe(self) -> str: ...

    def stop(self) -> None: ...


@dataclass
class ProcessMember:
    rank: int
    process: Any  # multiprocessing's SpawnProcess

    def is_alive(self) -> bool:
        return bool(self.process.is_alive())

    def describe(self) -> str:
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"rank {self.rank} exited ({how})"

    def stop(self) -> None:
        self.process.join(STOP_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@dataclass
class ThreadMember:
    """Under torchrun: world rank 0's loop, a thread of the front end's own process."""

    thread: threading.Thread

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def describe(self) -> str:
        return "rank 0's loop ended"

    def stop(self) -> None:
        self.thread.join(STOP_S)


# A killed rank's exit shows only once the kernel has freed its memory (~0.1 s per GB on an idle 2-core host, more
# under load), after its sockets closed: a peer's "fatal" report may come first, and waits this long for a peer's
# exit. Only the failure path waits, in full only where no peer exits (the reporter failed on its own).
FATAL_PEER_S = 2.0
FATAL_POLL_S = 0.02  # a peer's exit is named within this long of showing


def failure_cause(members: list[Member], reporter: Member, error: str) -> str:
    """Why the ranks stopped when `reporter` reports `error`: a peer that died is the cause of the reporter's failed
    collective, named first, with the reporter's error (an exit code does not say which came first: a peer also
    exits, code 1, when the reporter fails)."""
    peers = [m for m in members if m is not reporter]
    deadline = time.monotonic() + FATAL_PEER_S
    while peers:
        gone = [m for m in peers if not m.is_alive()]
        if gone or time.monotonic() > deadline:
            return f"{gone[0].describe()}; {error}" if gone else error
        time.sleep(FATAL_POLL_S)
    return error
