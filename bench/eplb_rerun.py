"""Re-measure ours' rows of every held-out matrix file in place, after a planner change: each file re-run by
`bench.eplb_matrix --update FILE` under its own sweep, trace seed, layers, windows and window tokens, over the cells
it holds, DeepSeek's and GRACE's rows copied from it (their code unchanged; --reuse) and ours' policies (ours,
ours-static, ours-dynamic) planned again. Then `python -m bench.eplb_report --latest` and `python -m bench.tables`
rebuild the claims.

The 22 files take ~25 minutes on the 2-core CPU machine with two jobs and a warm --mix-cache (the token-mix fits,
token_mix.py, are most of a cold run: ~1.5 hours). Largest files first, so the two jobs end together.

--others: the other result files with ours' plans in them as well, each re-run whole by its own bench into its own
file: `--keep-groups` against hierarchical (6 files, ~8 min a main seed and ~1 min a sample-mix one on one core), the
churn trade-off (1, ~7 min), node copies (1, ~25 min) and the default policy's backtest (8, ~14 min a main file and ~2
min a sample-mix one).
Their ours rows go stale as the matrix's do (the keep-groups SGLang-dump cells once missed a drift-call change for a
day); tests/bench/test_eplb_results_current.py re-runs a few small cells of each kind.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.eplb_keep_groups import out_file as keep_file
from bench.eplb_matrix_results import RESULTS
from bench.eplb_report import held_out_docs

MIX_CACHE = Path(".mixcache")  # git-ignored


def command(path: Path, doc: dict, mix_cache: Path, nodes: list[int] | None = None) -> list[str]:
    """The eplb_matrix call that re-measures ours' rows of the result file `path` (its JSON `doc`): its own args;
    nodes: only the cells on these node counts (None: all of the file's)."""
    a = doc["args"]
    cmd = [sys.executable, "-m", "bench.eplb_matrix", "--sweep", doc["sweep"], "--seed", str(a["seed"]),
           "--layers", str(a["layers"]), "--windows", str(a["windows"]), "--window-tokens", str(a["window_tokens"]),
           "--update", str(path), "--mix-cache", str(mix_cache)]
    return cmd + (["--nodes", *map(str, nodes)] if nodes else [])


def other_commands(mix_cache: Path) -> list[tuple[Path, list[str]]]:
    """(result file, the bench call that writes it again) for --others: the keep-groups, churn-curve and default-policy
    files of bench/results, each with the arguments its name says (trace seed, sweep, dispatch)."""
    py = [sys.executable, "-m"]
    out: list[tuple[Path, list[str]]] = []
    for sweep in ("main", "sample-mix"):
        for seed in (0, 1, 2):
            path = keep_file(seed, sweep)
            out.append((path, [*py, "bench.eplb_keep_groups", "--seed", str(seed), "--sweep", sweep, "--mix-cache",
                               str(mix_cache), "--out", str(path)]))
    out.append((RESULTS / "eplb-churn-curve.json", [*py, "bench.eplb_churn_curve", "--jobs", "1", "--out",
                                                    str(RESULTS / "eplb-churn-curve.json")]))
    out.append((RESULTS / "eplb-node-copies.json", [*py, "bench.eplb_node_copies", "--jobs", "1", "--out",
                                                    str(RESULTS / "eplb-node-copies.json")]))
    autos = [("", []), ("-seed1", ["--seed", "1"]), ("-seed2", ["--seed", "2"]), ("-static", ["--dispatch", "static"]),
             ("-dynamic", ["--dispatch", "dynamic"]), ("-sample-mix", ["--sweep", "sample-mix"]),
             ("-sample-mix-seed1", ["--sweep", "sample-mix", "--seed", "1"]),
             ("-sample-mix-seed2", ["--sweep", "sample-mix", "--seed", "2"])]
    for tail, flags in autos:
        path = RESULTS / f"eplb-auto{tail}.json"
        out.append((path, [*py, "bench.eplb_auto", *flags, "--out", str(path)]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--mix-cache", default=str(MIX_CACHE), help="folder of ours' token-mix fits, kept across runs")
    ap.add_argument("--smoke", action="store_true",
                    help="the sample model's file, its two-node cells, re-measured in a copy (nothing written here)")
    ap.add_argument("--others", action="store_true",
                    help="also the keep-groups, churn-curve, node-copies and default-policy files, each by its own "
                         "bench")
    args = ap.parse_args()
    docs = held_out_docs()
    if args.smoke:
        src = next(f for f, d in docs.items() if d["sweep"] == "sample")
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / src.name
            shutil.copy(src, copy)
            subprocess.run(command(copy, docs[src], Path(tmp) / "mix", [2]), check=True, stdout=subprocess.DEVNULL)
            before = {r["cell"]: r for r in docs[src]["results"]}
            after = json.loads(copy.read_text())
            for r in (r for r in after["results"] if r["nodes"] == 2):  # what the planner change moved, cell by cell
                old, new = before[r["cell"]]["policies"]["ours"], r["policies"]["ours"]
                print(f"{r['cell']}: ours held out {sum(old['bal_even']) / len(old['bal_even']):.4f} -> "
                      f"{sum(new['bal_even']) / len(new['bal_even']):.4f}")
        return
    mix = Path(args.mix_cache)
    mix.mkdir(parents=True, exist_ok=True)
    calls = [(f, command(f, docs[f], mix)) for f in sorted(docs, key=lambda f: -len(docs[f]["results"]))]
    todo = calls + (other_commands(mix) if args.others else [])

    def run(call: tuple[Path, list[str]]) -> tuple[Path, int, str]:
        done = subprocess.run(call[1], capture_output=True, text=True)
        return call[0], done.returncode, done.stderr[-2000:]

    failed = []
    with ThreadPoolExecutor(args.jobs) as ex:
        for path, rc, err in ex.map(run, todo):
            print(f"{path}: {'updated' if rc == 0 else f'failed (exit {rc})'}", flush=True)
            if rc:
                print(err, file=sys.stderr)
                failed.append(path)
    if failed:
        raise SystemExit(f"{len(failed)} of {len(todo)} files failed")


if __name__ == "__main__":
    main()
