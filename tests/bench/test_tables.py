"""BENCHMARKS.md's tables against bench/results/latest.json, the file they are generated from (bench/tables.py).

Run: .venv/bin/pytest tests/bench/test_tables.py -q   (CPU, about a second)
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from bench.tables import LATEST, REPORT, load, render, rewrite, stale

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def latest() -> dict:
    return load()


def test_every_table_matches_latest_json(latest: dict) -> None:
    report = REPORT.read_text()
    out, problems = rewrite(report, latest)
    assert problems == []
    assert stale(report, latest) == [], "run: python -m bench.tables"
    assert out == report


def test_a_changed_figure_is_seen(latest: dict) -> None:
    """Edit one number in latest.json: the report is then out of date, and only that claim's table differs."""
    edited = copy.deepcopy(latest)
    claim = next(c for c in edited["claims"] if c["id"] == "mla-decode-16-heads")
    claim["rows"][0]["ms"] *= 2
    report = REPORT.read_text()
    assert stale(report, edited) == ["mla-decode-16-heads"]
    out, _ = rewrite(report, edited)
    assert out != report and render(claim, edited["hardware"]) in out


def test_every_claim_is_complete(latest: dict) -> None:
    """Each claim names its hardware, shapes, baseline, command and sources, and every row fills every column."""
    ids = [c["id"] for c in latest["claims"]]
    assert len(ids) == len(set(ids))
    for c in latest["claims"]:
        assert c["hardware"] in latest["hardware"], c["id"]
        for field in ("shapes", "baseline", "command"):
            assert c[field].strip(), (c["id"], field)
        assert c["sources"] and c["rows"], c["id"]
        keys = [k for k, _, _ in c["columns"]]
        for row in c["rows"]:
            assert sorted(row) == sorted(keys), (c["id"], row)


def test_every_source_exists(latest: dict) -> None:
    """A result file a table cites is in the tree (git history keeps the rest); a source that is prose names a file."""
    for c in latest["claims"]:
        for src in c["sources"]:
            path = src.split(" ", 1)[0]
            assert (ROOT / path).is_file(), (c["id"], path)


def test_anchors_other_files_link_to_exist() -> None:
    """The headings docs and code link to (`BENCHMARKS.md#anchor`) are in the report, as GitHub spells anchors."""
    report = REPORT.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", report, re.M)}
    for required in ("goals", "mla-decode", "fused-moe", "capture-overhead", "eplb", "parallel", "end-to-end"):
        assert required in anchors
    for link in re.findall(r"\]\(#([a-z0-9-]+)\)", report):
        assert link in anchors, link
    linking = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md")]
    linking += [*ROOT.glob("engine/**/*.py"), *ROOT.glob("kernels/**/*.py"), *ROOT.glob("r3trace/**/*.py")]
    for path in linking:
        for link in re.findall(r"BENCHMARKS\.md#([a-z0-9-]+)", path.read_text()):
            assert link in anchors, f"{path.relative_to(ROOT)} links BENCHMARKS.md#{link}"


def test_latest_json_is_what_bench_tables_reads() -> None:
    assert LATEST == ROOT / "bench" / "results" / "latest.json"
    json.loads(LATEST.read_text())
