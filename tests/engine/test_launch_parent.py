"""A spawned rank whose front end is gone while it starts exits with one line instead of waiting in
init_process_group for peers that will never come (engine/launch/worker.py, WorkerSpec.parent_pid).

Run: .venv/bin/pytest -q tests/engine/test_launch_parent.py   (a few seconds: one python process)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "model"

RANK = """
import sys
from pathlib import Path
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.launch.config import LaunchConfig
from r3trace.engine.launch.worker import WorkerSpec, rank_main
model, store, parent = sys.argv[1], sys.argv[2], int(sys.argv[3])
# rank 0 of 2: without its peer, init_process_group waits until collective_timeout_s (120 s by default)
spec = WorkerSpec(Path(model), EngineConfig(), LaunchConfig(tp_size=2), f"file://{store}", 1, parent)
rank_main(0, spec, None, None)
"""


def test_rank_exits_with_one_line_when_its_front_end_is_gone(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is not this rank's parent: the front end that spawned it has exited
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", RANK, str(SAMPLE), str(tmp_path / "store"), str(gone.pid)],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    elapsed = time.monotonic() - start
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr[-2000:]
    assert lines == [f"r3trace rank 0: the front end (pid {gone.pid}) exited while the rank started"]
    assert elapsed < 10, f"the rank took {elapsed:.1f} s to notice"
