"""The ranks as the front end's watchdog sees them: alive or not, why they ended, how to stop them."""

from __future__ import annotations

import threading
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
