"""`r3trace <command>`: the parser is built from (name, module) registrations.

A command module defines HELP (one line), `add_arguments(parser)` and `run(args) -> int`, and keeps its
heavy imports inside `run`, so `r3trace --help` imports no DuckDB, torch or engine. To add a command,
append one (name, "package.module") line to COMMANDS, or expose it from another distribution under the
entry-point group "r3trace.commands" (value "package.module").

Errors: a user error (r3trace/errors.py: a missing path, a bad flag, a corrupt file, an SQL typo) is one
line on stderr, `r3trace <command>: <message>`, exit 2; any other exception is one line too, "internal
error: ...", exit 1; Ctrl-C exits 130. `--debug` adds the traceback. The global options `--debug` and
`--progress auto|on|off` may come before or after the command name.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import NoReturn

from r3trace.errors import UsageError, is_user_error, one_line
from r3trace.progress import PROGRESS_MODES

COMMANDS: list[tuple[str, str]] = [
    ("sql", "r3trace.commands.sql"),
    ("stats", "r3trace.commands.stats"),
    ("eplb", "r3trace.commands.eplb"),
    ("diff", "r3trace.commands.diff"),
    ("synth", "r3trace.commands.synth"),
    ("ingest", "r3trace.commands.ingest"),
    ("export", "r3trace.commands.export"),
    ("migrate", "r3trace.commands.migrate"),
    ("replay-check", "r3trace.commands.replay_check"),
    ("demo", "r3trace.demo"),
]
EXIT_USER_ERROR = 2  # argparse's own code for usage errors
EXIT_INTERNAL_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, naming the flag) instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)", prog=self.prog)


def registered() -> list[tuple[str, str]]:
    extra = [(ep.name, ep.value) for ep in entry_points(group="r3trace.commands")]
    names = {n for n, _ in COMMANDS}
    return COMMANDS + [(n, m) for n, m in extra if n not in names]


def global_options(top_level: bool) -> Parser:
    """--debug and --progress. Repeated on every subcommand with SUPPRESS defaults, so either position works
    and a subcommand that omits them keeps the top-level value."""
    p = Parser(add_help=False)
    p.add_argument("--debug", action="store_true", default=False if top_level else argparse.SUPPRESS,
                   help="on an error, print the full traceback")
    p.add_argument("--progress", choices=PROGRESS_MODES, default="auto" if top_level else argparse.SUPPRESS,
                   help="progress bars on stderr: auto (only on a terminal, the default), on, off")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="r3trace", description="capture and analyse MoE routing traces",
                    parents=[global_options(top_level=True)])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in registered():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP, parents=[global_options(False)])
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def report(exc: BaseException, prog: str, debug: bool) -> int:
    """Prints `exc` as one line on stderr (after its traceback with --debug); returns the exit code."""
    if debug:
        traceback.print_exception(exc)
    if is_user_error(exc):
        print(f"{getattr(exc, 'prog', None) or prog}: {one_line(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    hint = "" if debug else "; rerun with --debug for the traceback"
    print(f"{prog}: internal error: {type(exc).__name__}: {one_line(exc)}{hint}", file=sys.stderr)
    return EXIT_INTERNAL_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog, debug = "r3trace", "--debug" in argv  # known before parsing, for errors parsing itself raises
    try:
        args = build_parser().parse_args(argv)
        prog, debug = f"r3trace {args.command}", args.debug
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `r3trace sql ... | head`: the reader left; stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_INTERNAL_ERROR
    except Exception as exc:
        return report(exc, prog, debug)


if __name__ == "__main__":
    sys.exit(main())
