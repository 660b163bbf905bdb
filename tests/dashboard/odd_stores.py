"""Stores the dashboard must survive, written with the real TraceWriter and, where a crash is simulated, by hand:

  empty    a folder with no runs
  zero     one run whose writer was closed before any row: manifest files=(), rows=0
  crashed  one run killed mid-write: the manifest lists part-00000 only (it is put back the way it was before
           part-00001 closed), part-00001.parquet lies beside it unlisted, part-00002.parquet.tmp is half
           written; in part-00000 request "done" finished, "cut" is marked finish_reason='unfinished' and
           "open" has routes but no row in the requests table
  foreign  one healthy run plus entries that are not runs: a stray .parquet, a .csv, a folder, and a
           run_id= folder without manifest.json
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from r3trace.trace import TraceWriter

KINDS = ("empty", "zero", "crashed", "foreign")
SHAPE = dict(model_name="odd", num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=8, top_k=2)
L = len(SHAPE["moe_layer_ids"])  # type: ignore[arg-type]


def _tokens(w: TraceWriter, rng: np.random.Generator, request_id: str, n: int, first_fwd: int) -> None:
    """n tokens of one request, one forward each (100 ms apart), distinct random experts per layer."""
    ids = np.stack([rng.permutation(8)[:2] for _ in range(n * L)]).reshape(n, L, 2)
    fwd = first_fwd + np.arange(n)
    w.append_tokens(request_id, np.arange(n), "prefill", "computed", fwd, fwd * 100_000_000, 0, ids)


def write_crashed(root: Path, rng: np.random.Generator) -> None:
    # 8 tokens x 3 layers = 24 rows per file; flush_rows=3 puts the open file's rows on disk as they come
    w = TraceWriter(root, run_id="crashed", rows_per_file=24, flush_rows=3, **SHAPE)  # type: ignore[arg-type]
    _tokens(w, rng, "done", 3, 0)
    w.add_request("done", tag="math", prompt_tokens=3, completion_tokens=0, finish_reason="stop")
    w.add_request("cut", prompt_tokens=3, finish_reason="unfinished")
    _tokens(w, rng, "cut", 3, 3)
    _tokens(w, rng, "open", 2, 6)  # 24 rows: part-00000 closes with "done" and "cut" in its requests file
    before = (w.run_dir / "manifest.json").read_text()
    _tokens(w, rng, "later", 8, 8)  # part-00001 closes
    _tokens(w, rng, "torn", 4, 16)  # part-00002.parquet.tmp, never closed
    (w.run_dir / "manifest.json").write_text(before)  # the kill came before the manifest named part-00001
    # no close(): the writer is dropped as a killed process would leave it


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
