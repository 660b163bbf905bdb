"""Every normal stop commits what was captured: the interpreter's exit, SIGTERM, SIGINT.

- One `atexit` hook, registered when this module is first imported, shuts down the registered producers
  (engines: they finish or abort their requests, whose rows then reach the writer) and then closes every
  open writer, in that order whatever order they were created in.
- SIGTERM's default action kills the process without running `atexit`. When a writer opens in the main
  thread and SIGTERM still has its default action, it is turned into `SystemExit(143)` (128 + 15, the
  status a shell reports for SIGTERM), which unwinds and runs the hook. A handler someone else installed
  (uvicorn's, an application's) is left alone. SIGINT already raises KeyboardInterrupt, which unwinds too.
- A writer holds an exclusive `flock` on `<run>/.writer.lock` while it records; the kernel drops it when the
  process dies, so a reader can tell a live recording from a crashed one (reader.run_state).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import weakref
from pathlib import Path
from typing import IO, Any, Protocol

try:
    import fcntl
except ImportError:  # not POSIX: no liveness lock; a recording run then reads as live until closed
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("r3trace.trace")
LOCK_NAME = ".writer.lock"


class _Producer(Protocol):
    def shutdown(self) -> None: ...


class _Closable(Protocol):
    def close(self) -> Any: ...


_producers: weakref.WeakSet[Any] = weakref.WeakSet()
_writers: weakref.WeakSet[Any] = weakref.WeakSet()


def register_producer(obj: _Producer) -> None:
    _producers.add(obj)


def register_writer(obj: _Closable) -> None:
    _writers.add(obj)
    install_sigterm_handler()


def unregister_writer(obj: _Closable) -> None:
    _writers.discard(obj)


def shutdown_all() -> None:
    """Producers first (their last rows reach the writers), then the writers. Errors are logged, not raised:
    one failing writer must not keep the others from committing."""
    for group, method in ((_producers, "shutdown"), (_writers, "close")):
        for obj in list(group):
            try:
                getattr(obj, method)()
            except Exception as exc:
                log.error("r3trace: %s.%s() at exit failed: %s", type(obj).__name__, method, exc)


atexit.register(shutdown_all)


def _sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def install_sigterm_handler() -> bool:
    """SIGTERM -> SystemExit in the main thread, when SIGTERM still has its default action; True if installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return signal.getsignal(signal.SIGTERM) is _sigterm
    signal.signal(signal.SIGTERM, _sigterm)
    return True


def hold_run_lock(run_dir: Path) -> IO[bytes] | None:
    """Open and exclusively lock `<run_dir>/.writer.lock` for the writer's lifetime."""
    f = open(run_dir / LOCK_NAME, "ab")  # noqa: SIM115 - held open until release_run_lock
    if fcntl is not None:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    return f


def release_run_lock(f: IO[bytes] | None) -> None:
    if f is not None:
        f.close()  # closing the descriptor drops the flock


def run_is_live(run_dir: Path) -> bool:
    """True while some process holds the run's writer lock (False when it died, whatever the manifest says)."""
    path = Path(run_dir) / LOCK_NAME
    if fcntl is None:
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock if it was taken
    return False
