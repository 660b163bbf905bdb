"""`r3trace stats`' scans on a big trace, each beside the query it replaced, timed in one run on the same files.

Run:   .venv/bin/python -m bench.stats_scans --tokens 2000000 --work /tmp/stats-bench   (synthesizes the trace there:
       2M tokens x 58 MoE layers = 116M rows, ~3 min; kept for the next run) [--out FILE]
Smoke: .venv/bin/python -m bench.stats_scans --smoke   (6 layers, 3,000 tokens; no file written)

Per scan: the baseline (the routes' heat; the list_distinct repeat test; the window partitioned by request string and
layer with the routes' heat), what `r3trace stats` runs now (the rollups where every routes file has one; a row's K ids
as columns compared pairwise; the packed sort key), both timed once in this process after one untimed warm-up read of
the files, their results checked equal before a time is reported.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.analysis import timed
from bench.result_file import machine, write_result
from r3trace.analysis.heat import imbalance
from r3trace.analysis.integrity import repeated_rows
from r3trace.analysis.locality import temporal_locality
from r3trace.analysis.store import TraceStore
from r3trace.analysis.synth import SynthConfig, write_synth

RESULT = Path(__file__).resolve().parent / "results" / "stats_scans.json"


def trace(work: Path, tokens: int, layers: int) -> Path:
    """A synthetic V3-shaped run under work/trace (written once: a later run with the same size reuses it)."""
    root = work / f"trace-{tokens}-{layers}"
    if not list(root.glob("run_id=*/manifest.json")):
        write_synth(root, SynthConfig(seed=0, num_hidden_layers=layers), tokens, run_id="big", progress=False)
    return root


def repeated_by_list_distinct(store: TraceStore, run_id: str, k: int) -> int:
    """The baseline repeat count: a list_distinct per row (what integrity.repeated_rows did before)."""
    row = store.con.execute("SELECT count(*) FILTER (WHERE len(list_distinct(topk_ids)) < ?) FROM routes "
                            "WHERE run_id = ?", [k, run_id]).fetchone()
    assert row is not None
    return int(row[0])


def measure(root: Path) -> dict[str, Any]:
    store = TraceStore(root)
    [run] = store.runs
    m, rid = run.manifest, run.manifest.run_id
    assert run.rollups_complete  # TraceWriter's files: the rollups count every routes row
    store.con.execute("SELECT count(*) FROM routes WHERE list_contains(topk_ids, -1)").fetchone()  # warm the cache
    rows: list[dict[str, Any]] = []

    def row(scan: str, base: tuple[float, Any], ours: tuple[float, Any], same: bool) -> None:
        if not same:
            raise AssertionError(f"{scan}: the two queries disagree")
        rows.append({"scan": scan, "baseline_s": base[0], "ours_s": ours[0], "ratio": base[0] / ours[0]})
        print(f"{scan}: {base[0]:.1f} s -> {ours[0]:.1f} s", flush=True)

    b, o = timed(lambda: imbalance(store.con, rid, source="routes")), timed(
        lambda: imbalance(store.con, rid, source="rollups"))
    row("imbalance (per layer): the routes' heat -> the rollups'", b, o, b[1].equals(o[1]))
    b = timed(lambda: repeated_by_list_distinct(store, rid, m.top_k))
    o = timed(lambda: repeated_rows(store.con, rid))
    row("rows repeating an expert: list_distinct a row -> its K ids as columns, compared pairwise", b, o,
        b[1] == o[1].rows)
    b = timed(lambda: temporal_locality(store.con, rid, source="routes", packed_key=False))
    o = timed(lambda: temporal_locality(store.con, rid, source="rollups"))
    same = (b[1]["pairs"].to_list() == o[1]["pairs"].to_list()
            and np.allclose(b[1].select("mean_overlap", "baseline").to_numpy(),
                            o[1].select("mean_overlap", "baseline").to_numpy(), rtol=1e-12, atol=0))
    row("temporal locality: window by (run, request, layer) + routes' heat -> one packed key + rollups' heat", b, o,
        same)
    total_b, total_o = sum(r["baseline_s"] for r in rows), sum(r["ours_s"] for r in rows)
    rows.append({"scan": "the three together", "baseline_s": total_b, "ours_s": total_o, "ratio": total_b / total_o})
    size = sum(p.stat().st_size for p in run.route_files)
    return {"rows": m.rows, "tokens": m.rows // m.num_moe_layers, "layers": m.num_moe_layers, "files": m.file_count,
            "routes_bytes": size, "results": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--work", default=None, help="folder the synthetic trace is written to and reused from")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    layers = 9 if args.smoke else 61  # num_hidden_layers: V3's 61 (58 MoE); the smoke's 6 MoE
    tokens = 3000 if args.smoke else args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) if args.work is None or args.smoke else Path(args.work)
        doc = {"args": vars(args), "machine": machine(), **measure(trace(work, tokens, layers))}
    write_result(doc, args.out, args.smoke, RESULT)


if __name__ == "__main__":
    main()
