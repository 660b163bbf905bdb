"""Argument checks the commands share: flag types that name their limit, run selection, model folders.

Light on purpose (no DuckDB, no torch): a bad flag or path is reported before any heavy import.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from r3trace.errors import StoreError, UsageError


def _parse(text: str, cast: type, what: str) -> Any:
    try:
        return cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {what}: {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (argparse names the flag in front of the message)."""
    value = _parse(text, int, "int value")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return int(value)


def nonnegative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    value = _parse(text, int, "int value")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return int(value)


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    value = _parse(text, float, "float value")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return float(value)


def _listed(ids: Sequence[str]) -> str:
    return ", ".join(ids[:5]) + (f", ... ({len(ids)} in all)" if len(ids) > 5 else "")


def select_run(ids: Sequence[str], run_id: str | None, where: str, flag: str = "--run-id") -> str:
    """The run a command works on, of the run ids `ids` found under `where`: `run_id` when given and
    there, else the only run."""
    if run_id is not None:
        if run_id not in ids:
            raise StoreError(f"{flag} {run_id}: no such run in {where} (runs: {_listed(ids)})")
        return run_id
    if len(ids) != 1:
        raise UsageError(f"{where} holds {len(ids)} runs ({_listed(ids)}); pick one with {flag}")
    return ids[0]


def check_out_dir(path: str | Path, flag: str) -> Path:
    """A folder runs are written into: missing is fine (created), a file is refused naming the flag."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {p} is a file; give a dataset folder (created when missing)")
    return p


def check_model_dir(path: str | Path, flag: str = "model") -> Path:
    """A checkpoint folder with config.json, checked before torch is imported."""
    p = Path(path)
    if not p.exists():
        raise StoreError(f"{flag} {p} does not exist (give a checkpoint folder with config.json and safetensors)")
    if not p.is_dir():
        raise StoreError(f"{flag} {p} is a file, not a folder (give the checkpoint folder: {p.parent})")
    if not (p / "config.json").is_file():
        raise StoreError(f"{flag} {p} has no config.json (give a Hugging Face checkpoint folder)")
    return p


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (0: any free port)."""
    value = _parse(text, int, "port")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} must be in 0..65535")
    return int(value)
