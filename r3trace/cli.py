"""`r3trace <command>`: the parser is built from (name, module) registrations.

A command module defines HELP (one line), `add_arguments(parser)` and `run(args) -> int`, and keeps its
heavy imports inside `run`, so `r3trace --help` imports no DuckDB, torch or engine. To add a command,
append one (name, "package.module") line to COMMANDS, or expose it from another distribution under the
entry-point group "r3trace.commands" (value "package.module").
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

COMMANDS: list[tuple[str, str]] = [
    ("sql", "r3trace.commands.sql"),
    ("stats", "r3trace.commands.stats"),
    ("eplb", "r3trace.commands.eplb"),
    ("diff", "r3trace.commands.diff"),
    ("synth", "r3trace.commands.synth"),
    ("ingest", "r3trace.commands.ingest"),
    ("replay-check", "r3trace.commands.replay_check"),
    ("demo", "r3trace.demo"),
]


def registered() -> list[tuple[str, str]]:
    extra = [(ep.name, ep.value) for ep in entry_points(group="r3trace.commands")]
    names = {n for n, _ in COMMANDS}
    return COMMANDS + [(n, m) for n, m in extra if n not in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="r3trace", description="capture and analyse MoE routing traces")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in registered():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
