"""`r3trace serve` start-up errors: one line on stderr naming the flag or path, exit 2, before the model loads.

Run: .venv/bin/pytest -q tests/server/test_serve_errors.py
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "model"


def serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "r3trace.cli", "serve", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    for n in needles:
        assert n in proc.stderr, (n, proc.stderr)


def test_bad_model_path(tmp_path: Path) -> None:
    proc = serve(str(tmp_path / "nope"), cwd=tmp_path)
    one_line(proc, f"r3trace serve: model {tmp_path / 'nope'} does not exist")
    (tmp_path / "m").mkdir()
    proc = serve(str(tmp_path / "m"), cwd=tmp_path)
    one_line(proc, f"model {tmp_path / 'm'} has no config.json")


def test_port_in_use_fails_before_the_model_loads(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")  # loading it would fail on model_type: the port is checked first
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve(str(model), "--port", str(port), cwd=tmp_path)
    one_line(proc, f"--host 127.0.0.1 --port {port}: cannot listen (Address already in use)",
             "pick a free --port")


def test_bad_flag_values(tmp_path: Path) -> None:
    proc = serve(str(SAMPLE), "--port", "70000", cwd=tmp_path)
    one_line(proc, "argument --port: 70000 must be in 0..65535")
    proc = serve(str(SAMPLE), "--cuda-graphs", "1,x", cwd=tmp_path)
    one_line(proc, "argument --cuda-graphs: '1,x': expected auto, off or a list")
