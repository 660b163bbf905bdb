"""BENCHMARKS.md's tables, generated from bench/results/latest.json (the latest measurement of every claim).

Run: .venv/bin/python -m bench.tables            rewrite every table between its markers in BENCHMARKS.md
     .venv/bin/python -m bench.tables --check    exit 1 and name the tables that differ (tests/bench/test_tables.py)

A claim in latest.json: `id` (also the heading anchor it sits under), `hardware` (a key of the file's `hardware`),
`shapes`, `baseline` (what was measured beside it in the same run), `command` (what re-measures it), `sources` (the
result files its figures come from), `columns` ([key, header, format]) and `rows` (key -> number, string or null).
A number is shown through its column's format (`str.format`), a string as it is, null as "-". BENCHMARKS.md holds
each table between `<!-- table:ID ... -->` and `<!-- /table:ID -->`; the prose around the markers is written by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LATEST = ROOT / "bench" / "results" / "latest.json"
REPORT = ROOT / "BENCHMARKS.md"
BLOCK = re.compile(r"<!-- table:(?P<id>[a-z0-9-]+)[^>]*-->\n.*?<!-- /table:(?P=id) -->", re.S)


def cell(value: Any, fmt: str) -> str:
    """One table cell: numbers through the column's format, strings as they are, None as '-'."""
    if value is None:
        return "-"
    text = value if isinstance(value, str) else fmt.format(value)
    return text.replace("|", "\\|")


def render(claim: dict[str, Any], hardware: dict[str, str]) -> str:
    """The block BENCHMARKS.md holds for one claim, markers included."""
    cid = claim["id"]
    sources = ", ".join(s if " " in s else f"`{s}`" for s in claim["sources"])
    lines = [
        f"<!-- table:{cid}: generated from bench/results/latest.json by `python -m bench.tables`; edit the JSON -->",
        f"Hardware: {hardware[claim['hardware']]}. Shapes: {claim['shapes']}. Baseline, same run: {claim['baseline']}. "
        f"Re-measure: `{claim['command']}`. From: {sources}.",
        "",
        "| " + " | ".join(head for _, head, _ in claim["columns"]) + " |",
        "|" + "---|" * len(claim["columns"]),
    ]
    for row in claim["rows"]:
        lines.append("| " + " | ".join(cell(row.get(key), fmt) for key, _, fmt in claim["columns"]) + " |")
    lines.append(f"<!-- /table:{cid} -->")
    return "\n".join(lines)


def load(path: Path = LATEST) -> dict[str, Any]:
    return json.loads(path.read_text())


def rewrite(report: str, latest: dict[str, Any]) -> tuple[str, list[str]]:
    """-> (the report with every table regenerated, problems: claims without a block, blocks without a claim)."""
    claims = {c["id"]: c for c in latest["claims"]}
    seen: list[str] = []

    def replace(m: re.Match[str]) -> str:
        seen.append(m["id"])
        claim = claims.get(m["id"])
        return render(claim, latest["hardware"]) if claim is not None else m.group(0)

    out = BLOCK.sub(replace, report)
    problems = [f"claim {cid} has no table block in BENCHMARKS.md" for cid in claims if cid not in seen]
    problems += [f"table block {cid} has no claim in latest.json" for cid in seen if cid not in claims]
    problems += [f"table block {cid} appears {seen.count(cid)} times" for cid in set(seen) if seen.count(cid) > 1]
    return out, problems


def stale(report: str, latest: dict[str, Any]) -> list[str]:
    """Ids of the tables whose text differs from what latest.json renders."""
    claims = {c["id"]: c for c in latest["claims"]}
    return [m["id"] for m in BLOCK.finditer(report)
            if m["id"] in claims and m.group(0) != render(claims[m["id"]], latest["hardware"])]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="report tables out of sync instead of rewriting them")
    ap.add_argument("--smoke", action="store_true", help="the same as --check (the bench smoke test's entry)")
    args = ap.parse_args(argv)
    latest, report = load(), REPORT.read_text()
    out, problems = rewrite(report, latest)
    for p in problems:
        print(p, file=sys.stderr)
    if args.check or args.smoke:
        for cid in stale(report, latest):
            print(f"table {cid} differs from latest.json: run python -m bench.tables", file=sys.stderr)
        return 1 if problems or out != report else 0
    if out != report:
        REPORT.write_text(out)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
