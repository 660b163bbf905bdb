"""The early drift test's statistic (r3trace/eplb/early_drift.py) on every trace of the held-out matrix with tokens:
the plain mean's error forecasting window t from windows 0 .. t - 1 over what the newest window's own sampling noise
gives it (~1 on an unchanged router), at t = 2 and 3 (three and four windows seen), on the raw windows and on the
windows at their long-run mix of kinds of token (token_mix, equal shares), with the noise from halves of alternate
tokens and of alternate contiguous blocks (the planner's). What set PlannerConfig.early_drift.

Run: .venv/bin/python -m bench.eplb_early_drift [--out FILE]   (every trace with tokens in the matrix's result files,
     seed 0-2: ~10 min on the 2-core machine, the token-mix fits most of it)
     .venv/bin/python -m bench.eplb_early_drift --smoke           (two small traces, nothing written: a few seconds)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.eplb_ours_loads import RESULTS, windows_of
from bench.eplb_report import held_out_docs
from bench.eplb_traces import TraceSpec
from r3trace.eplb.early_drift import NOISE_BLOCKS, change_ratio, half_noise
from r3trace.eplb.score import heat_of
from r3trace.eplb.token_mix import COMPONENTS, EM_LAYERS, choose_components

OUT = RESULTS / "eplb-early-drift.json"
STEPS = (2, 3)  # the windows scored: the first re-plans' (three and four windows seen)


def measure(spec: TraceSpec, demix: bool = True) -> dict[str, Any]:
    """One trace -> at each of STEPS: the ratio on the raw windows and (demix) on the de-mixed ones, each with the
    noise of alternate tokens and of alternate blocks."""
    routes, sees = windows_of(spec)
    if not sees:
        raise ValueError(f"family={spec.family!r}: no tokens, no noise estimate")
    e = spec.num_experts
    row: dict[str, Any] = {"family": spec.family, "drift": spec.drift, "zipf_s": spec.zipf_s, "seed": spec.seed}
    for t in STEPS:
        raw = np.stack([heat_of(w, e) for w in routes[:t + 1]])
        v_tok, v_blk = half_noise(routes[t], e, None), half_noise(routes[t], e, NOISE_BLOCKS)
        row[f"t{t}"] = {"raw": [change_ratio(raw, v_tok), change_ratio(raw, v_blk)]}
        if demix:
            mix, _ = choose_components(list(routes[:t + 1]), e, COMPONENTS, EM_LAYERS)
            kinds = int(mix.p.shape[1])
            demixed = mix.loads(raw) if kinds > 1 else raw
            row[f"t{t}"].update({"demixed": [change_ratio(demixed, v_tok), change_ratio(demixed, v_blk)],
                                 "kinds": kinds})
    return row


def specs(docs: dict[Path, dict[str, Any]]) -> list[TraceSpec]:
    """The distinct traces with tokens (not SGLang dumps) in these matrix result files (bench/eplb_report's
    held_out_docs), in file order."""
    out: list[TraceSpec] = []
    for f in sorted(docs):
        for r in docs[f].get("results", []):
            spec = TraceSpec(**r["spec"])
            if spec.family != "sglang-dump" and spec not in out:
                out.append(spec)
    return out


def ranges(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """rows -> {family/drift: {tN source noise: [min, max]}} over trace seeds and skews."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        into = out.setdefault(f"{r['family']}/{r['drift']}", {})
        for t in STEPS:
            for src in ("raw", "demixed"):
                for i, how in enumerate(("tokens", "blocks")):
                    if src in r[f"t{t}"]:
                        x = r[f"t{t}"][src][i]
                        lo, hi = into.get(f"t{t} {src} {how}", [x, x])
                        into[f"t{t} {src} {how}"] = [min(lo, x), max(hi, x)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--smoke", action="store_true", help="two small traces (one fast, one still), nothing written")
    args = ap.parse_args()
    if args.smoke:
        todo = [TraceSpec(family="grouped", drift=d, num_layers=2, windows=4, window_tokens=2048)
                for d in ("none", "fast")]
    else:
        todo = specs(held_out_docs())
    rows = []
    for spec in todo:
        rows.append(measure(spec))
        print(rows[-1], flush=True)
    if not args.smoke:
        Path(args.out).write_text(json.dumps({"rows": rows, "ranges": ranges(rows)}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
