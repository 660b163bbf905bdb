"""A writer killed with SIGKILL leaves complete files and a manifest matching them.
Run: .venv/bin/python -m pytest tests/analysis/test_crash.py -q"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq

from r3trace.trace import Manifest, open_dataset, recover_run

WRITER = textwrap.dedent("""
    import sys, numpy as np
    from r3trace.trace import TraceWriter
    w = TraceWriter(sys.argv[1], model_name="t", num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=32,
                    top_k=4, run_id="k", rows_per_file=3000, flush_rows=600)
    rng = np.random.default_rng(4)
    f = 0
    while True:  # runs until killed
        ids = rng.integers(0, 32, (50, 3, 4)).astype(np.int32)
        w.append_tokens(np.full(50, "r%d" % (f % 7)), np.arange(50), "decode", "computed", f, f * 10**6, 0, ids)
        f += 1
""")


def test_sigkill_leaves_only_complete_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], env=env)
    run_dir = root / "run_id=k"
    deadline = time.time() + 60
    while time.time() < deadline:  # kill once several files are closed and another is half-written
        if (run_dir / "manifest.json").exists() and Manifest.read(run_dir).file_count >= 3:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    m = Manifest.read(run_dir)
    assert m.file_count >= 3
    listed = {f.name for f in m.files}
    on_disk = {p.name for p in run_dir.glob("part-*.parquet")}
    # a file renamed in the microseconds before its manifest update may be unlisted; never the reverse
    assert listed <= on_disk and len(on_disk - listed) <= 1
    for f in m.files:
        assert pq.read_metadata(run_dir / f.name).num_rows == f.rows  # complete and readable
        assert f.rollup is not None and (run_dir / f.rollup).exists()
    assert m.rows == sum(f.rows for f in m.files)
    assert open_dataset(root)[0].manifest.rows == m.rows  # readers go by the manifest
    after = recover_run(run_dir)
    assert not list(run_dir.glob("*.tmp"))
    assert {f.name for f in after.files} == on_disk
