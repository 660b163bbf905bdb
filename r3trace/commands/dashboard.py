"""r3trace dashboard [STORE]: the Streamlit dashboard over a trace store, bound to 127.0.0.1."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HELP = "open the Streamlit dashboard over a trace store (heat, imbalance, diff, EPLB planner, SQL)"


def app_path() -> Path:
    """dashboards/app.py of this source checkout (the dashboard ships beside the package, not in it)."""
    return Path(__file__).resolve().parents[2] / "dashboards" / "app.py"


def streamlit_command(store: str, host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(app_path()), "--server.address", host,
            "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--", store]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", nargs="?", default=".", help="dataset folder of runs (default: current folder)")
    p.add_argument("--host", default="127.0.0.1", help="bind address; loopback unless told otherwise")
    p.add_argument("--port", type=int, default=8501)


def run(args: argparse.Namespace) -> int:
    store = Path(args.store).resolve()
    if not store.is_dir():
        print(f"r3trace dashboard: store {store} is not a folder", file=sys.stderr)
        return 2
    if not app_path().is_file():
        print(f"r3trace dashboard: {app_path()} not found (run from a source checkout)", file=sys.stderr)
        return 2
    print(f"dashboard for {store}: http://{args.host}:{args.port}/", flush=True)
    env = {**os.environ, "R3TRACE_STORE": str(store)}
    return subprocess.call(streamlit_command(str(store), args.host, args.port), env=env)
