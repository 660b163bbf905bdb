"""bench/eplb_rerun.py --others: every committed result file of the keep-groups, churn-curve, node-copies and
default-policy benches is written again by a call of its own bench whose arguments match the file (a file added without
a call fails here).
Run: .venv/bin/pytest tests/bench/test_eplb_rerun.py -q"""

from __future__ import annotations

import json
from pathlib import Path

from bench.eplb_matrix_results import RESULTS
from bench.eplb_rerun import other_commands


def _flag(cmd: list[str], name: str, default: str) -> str:
    return cmd[cmd.index(name) + 1] if name in cmd else default


def test_others_write_every_such_file_with_its_own_arguments(tmp_path: Path) -> None:
    calls = other_commands(tmp_path / "mix")
    paths = [p for p, _ in calls]
    want = {*RESULTS.glob("eplb-keep-groups*.json"), *RESULTS.glob("eplb-auto*.json"),
            RESULTS / "eplb-churn-curve.json", RESULTS / "eplb-node-copies.json"}
    assert len(paths) == len(set(paths)) == 16 and set(paths) == want
    for path, cmd in calls:
        assert cmd[cmd.index("--out") + 1] == str(path)
        doc = json.loads(path.read_text())
        if "keep-groups" in path.name:  # the file's own args: trace seed and sweep
            assert cmd[2] == "bench.eplb_keep_groups" and "--mix-cache" in cmd
            assert int(_flag(cmd, "--seed", "0")) == doc["args"]["seed"]
            assert _flag(cmd, "--sweep", "main") == doc["args"].get("sweep", "main")
        elif "auto" in path.name:  # the default-policy files name their dispatch and cells' family
            assert cmd[2] == "bench.eplb_auto"
            assert _flag(cmd, "--dispatch", "node-limited") == doc["dispatch"]
            mix = {r["spec"]["family"] for r in doc["results"]} == {"sample-mix"}
            assert (_flag(cmd, "--sweep", "main") == "sample-mix") == mix
            assert {r["spec"]["seed"] for r in doc["results"]} == {int(_flag(cmd, "--seed", "0"))}
        elif "node-copies" in path.name:
            assert cmd[2] == "bench.eplb_node_copies"
        else:
            assert cmd[2] == "bench.eplb_churn_curve"
