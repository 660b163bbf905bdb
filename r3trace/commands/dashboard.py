"""r3trace dashboard [STORE]: the Streamlit dashboard over a trace store, bound to 127.0.0.1.

The server runs in this process (Streamlit's own `streamlit run` entry point, called in-process), so the
process owns it: SIGTERM, SIGINT or SIGQUIT stop the server and exit, and SIGKILL leaves nothing behind
because there is no child process to orphan.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.resources import files
from pathlib import Path

HELP = "open the Streamlit dashboard over a trace store (heat, imbalance, diff, EPLB planner, SQL)"
STORE_ENV = "R3TRACE_STORE"  # read by dashboards/store_cache.py
SQL_TIMEOUT_ENV = "R3TRACE_SQL_TIMEOUT_S"


def app_path() -> Path:
    """app.py of the installed package r3trace.dashboards: the wheel's copy, or dashboards/ of an editable
    checkout (pyproject maps the folder to that package, so both resolve the same way)."""
    return Path(str(files("r3trace.dashboards").joinpath("app.py")))


def streamlit_args(store: str, host: str, port: int) -> list[str]:
    """The `streamlit` command line (without the program) that serves the dashboard."""
    return ["run", str(app_path()), "--server.address", host, "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false", "--", store]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", nargs="?", default=".", help="dataset folder of runs (default: current folder)")
    p.add_argument("--host", default="127.0.0.1", help="bind address; loopback unless told otherwise")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument("--sql-timeout-s", type=int, default=30,
                   help="time limit of a query on the SQL page, in seconds (the page can lower it; default 30)")


def run(args: argparse.Namespace) -> int:
    store = Path(args.store).resolve()
    if not store.is_dir():
        what = "does not exist" if not store.exists() else "is not a folder"
        print(f"r3trace dashboard: store {store} {what}", file=sys.stderr)
        return 2
    if not app_path().is_file():
        print(f"r3trace dashboard: {app_path()} not found (reinstall r3trace: its wheel ships the app)",
              file=sys.stderr)
        return 2
    if args.sql_timeout_s < 1:
        print(f"r3trace dashboard: --sql-timeout-s={args.sql_timeout_s} must be >= 1", file=sys.stderr)
        return 2
    from streamlit.web import cli as streamlit_cli

    print(f"dashboard for {store}: http://{args.host}:{args.port}/", flush=True)
    os.environ[STORE_ENV] = str(store)
    os.environ[SQL_TIMEOUT_ENV] = str(args.sql_timeout_s)
    # standalone_mode=False: click returns here instead of calling sys.exit, and Streamlit installs its
    # SIGTERM/SIGINT/SIGQUIT handlers (server.stop()) in this process
    streamlit_cli.main.main(args=streamlit_args(str(store), args.host, args.port), prog_name="streamlit",
                            standalone_mode=False)
    return 0
