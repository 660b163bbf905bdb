"""Where a bench run's result document goes: `--out FILE` where given, else the script's own result file under
bench/results/, and nowhere on a `--smoke` run without `--out` (tests/bench/test_smoke.py runs every script so)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_result(doc: dict[str, Any], out: str | None, smoke: bool, default: Path) -> Path | None:
    """doc -> the path it was written to (indented JSON, the line `wrote PATH` printed), or None on a smoke run
    without `out`."""
    path = Path(out) if out else (None if smoke else default)
    if path is not None:
        path.write_text(json.dumps(doc, indent=1))
        print(f"wrote {path}")
    return path
