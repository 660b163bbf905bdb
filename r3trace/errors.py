"""Errors a person fixes (a path, a field, a flag value), told apart from bugs.

`r3trace` prints a user error as one line on stderr, `r3trace <command>: <message>`, and exits 2; any other
exception is an internal error, also one line (exit 1), and `--debug` adds the traceback (r3trace/cli.py).

`UserError` is the root for errors raised by the CLI layer. The typed errors defined next to the code that
checks the value (TraceSchemaError, EngineConfigError, ...) are user errors too; they are named in
USER_ERRORS by import path and matched only when their module is already imported, so classifying an
exception imports nothing (`r3trace --help` stays free of DuckDB and torch).
"""

from __future__ import annotations

import sys


class UserError(Exception):
    """The message is the whole line the user sees: it names the path or flag and what to do."""


class StoreError(UserError, ValueError):
    """A store path that does not exist, is a file, holds an unreadable manifest or no r3trace runs.

    A ValueError too, as TraceSchemaError (what TraceStore raised for a bad path before) is: callers that
    catch ValueError keep working."""


class UsageError(UserError):
    """A command-line flag that argparse or a command rejects; `prog` names the (sub)command when known."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


# module -> class names; each is a ValueError or similar raised with the field, the value and the limit.
USER_ERRORS: dict[str, tuple[str, ...]] = {
    "r3trace.trace.schema": ("TraceSchemaError",),
    "r3trace.analysis.store": ("StoreQueryError",),
    "r3trace.analysis.ingest": ("IngestError",),
    "r3trace.eplb.placement": ("PlacementError",),
    "r3trace.capture.wire": ("WireFormatError",),
    "r3trace.capture.config": ("CaptureConfigError",),
    "r3trace.server.config": ("ServerConfigError",),
    "r3trace.client": ("CaptureError",),
    "r3trace.engine.model_config": ("ConfigError",),
    "r3trace.engine.weights": ("WeightsError",),
    "r3trace.engine.engine_config": ("EngineConfigError",),
    "r3trace.engine.request": ("InvalidRequestError",),
    "pyarrow.lib": ("ArrowInvalid",),  # a Parquet file that is not one
}
# DuckDB's errors are the user's (SQL typos, unreadable files, limits) except these two.
DUCKDB_INTERNAL = ("InternalException", "FatalException")


def _loaded(module: str, names: tuple[str, ...]) -> tuple[type, ...]:
    mod = sys.modules.get(module)
    return tuple(getattr(mod, n) for n in names if hasattr(mod, n)) if mod is not None else ()


def is_user_error(exc: BaseException) -> bool:
    if isinstance(exc, UserError):
        return True
    if isinstance(exc, OSError) and exc.filename is not None:  # a missing or unreadable file the user named
        return True
    duck = sys.modules.get("duckdb")
    if duck is not None and isinstance(exc, duck.Error):
        return not isinstance(exc, _loaded("duckdb", DUCKDB_INTERNAL))
    return any(isinstance(exc, _loaded(m, names)) for m, names in USER_ERRORS.items())


# DuckDB's words for a store file that is missing or not Parquet; its message names the file
DAMAGED_FILE = ("No files found that match the pattern", "No magic bytes found", "not a parquet file")


def one_line(exc: BaseException) -> str:
    """The message as one line: its first line, plus DuckDB's "Did you mean ..." hint when there is one,
    what to do about a damaged trace file, or the first items of a list the first line announces."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    if lines[0].endswith(":") and len(lines) > 1:  # a header over a list (WeightsError): its first items
        more = f"; ... ({len(lines) - 4} more; --debug prints all)" if len(lines) > 4 else ""
        return f"{lines[0]} {'; '.join(lines[1:4])}{more}"
    hints = [ln for ln in lines[1:] if ln.startswith("Did you mean")]
    if ".parquet" in lines[0] and any(s in lines[0] for s in DAMAGED_FILE):
        hints.append("(a file a manifest lists is missing or damaged: restore it, or move its run_id=* folder "
                     "out of the store)")
    return " ".join([lines[0], *hints])
