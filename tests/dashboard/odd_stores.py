"""Stores the dashboard must survive, written with the real TraceWriter:

  empty    a folder with no runs
  zero     one run whose writer was closed before any row: manifest files=(), rows=0
  crashed  one run whose writer process was killed (SIGKILL) mid-run: its last commit (`flush()`) lists
           part-00000 with request "done" (finished, finish_reason 'stop') and "open" (routes, no
           add_request: in the manifest's open_requests); after it, tokens of "later" that were never
           committed, and what a kill leaves beside the listed files: a copy of part-00000 under the unlisted
           name part-00007.parquet (renamed, manifest not yet written) and a torn part-00008.parquet.tmp
  foreign  one healthy run plus entries that are not runs: a stray .parquet, a .csv, a folder, and a
           run_id= folder without manifest.json
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from r3trace.trace import TraceWriter

KINDS = ("empty", "zero", "crashed", "foreign")
SHAPE = dict(model_name="odd", num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2)
L = len(SHAPE["moe_layer_ids"])  # type: ignore[arg-type]
REPO = Path(__file__).resolve().parents[2]


def _tokens(w: TraceWriter, rng: np.random.Generator, request_id: str, n: int, first_fwd: int) -> None:
    """n tokens of one request, one forward each (100 ms apart), distinct random experts per layer."""
    ids = np.stack([rng.permutation(8)[:2] for _ in range(n * L)]).reshape(n, L, 2)
    fwd = first_fwd + np.arange(n)
    w.append_tokens(request_id, np.arange(n), "prefill", "computed", fwd, fwd * 100_000_000, 0, ids)


# The crashed run's writer, in a child process that the parent kills: a real crash (no close(), no atexit, the
# kernel drops the writer's lock), not one faked in-process. flush_interval_s=None: commits only on flush().
CRASH_CHILD = textwrap.dedent("""
    import shutil, sys, time
    import numpy as np
    from r3trace.trace import TraceWriter
    from tests.dashboard.odd_stores import SHAPE, _tokens

    root, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    w = TraceWriter(root, run_id="crashed", flush_interval_s=None, **SHAPE)
    _tokens(w, rng, "done", 3, 0)
    w.add_request("done", tag="math", prompt_tokens=3, completion_tokens=0, finish_reason="stop")
    _tokens(w, rng, "open", 2, 3)  # no add_request: still running at the commit
    w.flush()  # the last commit: part-00000 (done, open), requests-00000 (done), open_requests ("open",)
    _tokens(w, rng, "later", 4, 5)  # never committed: lost with the process
    d = w.run_dir.parent / "routes" / w.run_dir.name  # the run's routes folder (r3trace/trace/layout.py)
    shutil.copyfile(d / "part-00000.parquet", d / "part-00007.parquet")  # renamed, not yet in the manifest
    (w.run_dir / "part-00008.parquet.tmp").write_bytes(rng.bytes(100))  # a write the kill cut short
    print("ready", flush=True)
    time.sleep(120)
""")


def write_crashed(root: Path, rng: np.random.Generator) -> None:
    """Record in a child process, SIGKILL it once it says "ready"."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    seed = str(int(rng.integers(2**31)))
    proc = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, str(root), seed], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else b""  # b"" also if the child failed before "ready"
        if line.strip() != b"ready":
            proc.kill()
            proc.wait(timeout=60)
            raise RuntimeError(f"crash child did not say ready (exit status {proc.returncode}): "
                               f"{proc.stderr.read().decode() if proc.stderr else ''}")
    finally:
        proc.kill()  # SIGKILL
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.returncode


def write_stores(base: Path, seed: int = 20) -> dict[str, Path]:
    rng = np.random.default_rng(seed)
    out = {k: base / k for k in KINDS}
    for p in out.values():
        p.mkdir(parents=True)
    TraceWriter(out["zero"], run_id="zero", **SHAPE).close()  # type: ignore[arg-type]
    write_crashed(out["crashed"], rng)
    with TraceWriter(out["foreign"], run_id="fine", **SHAPE) as w:  # type: ignore[arg-type]
        _tokens(w, rng, "q", 6, 0)
        w.add_request("q", prompt_tokens=6, completion_tokens=0, finish_reason="stop")
    f = out["foreign"]
    (f / "stray.parquet").write_bytes(rng.bytes(64))
    (f / "notes.csv").write_text("layer,count\n1,2\n")
    (f / "plots").mkdir()
    (f / "run_id=ghost").mkdir()
    return out
