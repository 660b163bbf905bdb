"""`r3trace eplb`'s report lines and refusals on a drifting trace (eplb_cli_trace.py): churn against --previous and
the re-plan's drift call, window and flag errors as one line naming the flag, the layout line, runs as windows, and
fewer history windows than asked.

Run: .venv/bin/pytest tests/analysis/test_eplb_report_lines.py -q
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r3trace.cli import main
from r3trace.eplb import Cluster, deepseek, from_phy2log, to_json
from r3trace.eplb.placement import from_json
from r3trace.trace import TraceWriter
from tests.analysis.eplb_cli_trace import (
    CLUSTER,
    L_IDS,
    E,
    K,
    even_balancedness,
    heat,
    run_cli,
    write_trace,
)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return write_trace(tmp_path_factory.mktemp("store"))


def test_churn_against_previous(trace: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An identical previous placement: 0 slots changed; one with layer 0's slots rolled by one: exactly the
    slots the roll moved, of all L x P."""
    first = tmp_path / "first.json"
    flags = (str(trace["root"]), *CLUSTER, "--policy", "global", "--train", "time=..8")
    run_cli(capsys, *flags, "--out", str(first))
    lines = run_cli(capsys, *flags, "--previous", str(first))
    assert lines[-2] == f"churn vs {first}: 0.00% of {3 * 24} slots changed expert (0)"
    assert lines[-1].startswith("re-plan vs keeping --previous, held out")  # the same placement: no gain
    assert lines[-1].endswith("balancedness +0.0000, nodes per token +0.000")
    pl, cluster = from_json(first.read_text())
    shifted = pl.phy2log.copy()
    shifted[0] = np.roll(shifted[0], 1)
    moved = int((shifted != pl.phy2log).sum())
    assert 0 < moved <= 24
    prev = tmp_path / "shifted.json"
    prev.write_text(to_json(from_phy2log(shifted, E), cluster))
    out = tmp_path / "again.json"
    lines = run_cli(capsys, *flags, "--previous", str(prev), "--out", str(out))
    assert json.loads(out.read_text())["meta"]["report"]["churn"] == moved / (3 * 24)
    assert lines[-2] == f"churn vs {prev}: {moved / 72:.2%} of 72 slots changed expert ({moved})"


def test_ours_says_how_it_re_planned(trace: dict[str, Any], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """ours re-planned from --previous prints its drift call (drift_call.DriftCall.note), and --out keeps it; global's
    report has none (it plans afresh)."""
    first = tmp_path / "first.json"
    flags = (str(trace["root"]), *CLUSTER, "--train", "time=..8")
    run_cli(capsys, *flags, "--policy", "ours", "--out", str(first))
    out = tmp_path / "again.json"
    lines = run_cli(capsys, *flags, "--policy", "ours", "--previous", str(first), "--out", str(out))
    note = json.loads(out.read_text())["meta"]["report"]["replan"]
    assert note.startswith(("still: ", "drifting: ")) and f"re-plan: {note}" in lines
    lines = run_cli(capsys, *flags, "--policy", "global", "--previous", str(first))
    assert not any(line.startswith("re-plan: ") for line in lines)


@pytest.mark.parametrize("args, message", [
    (["--train", "time=0.5.."], "--train time=0.5s..: 0.5 s is not a multiple of run a's rollup window (1 s)"),
    (["--train", "time=..8", "--eval", "time=6.."], "--eval time=6s..: overlaps --train time=..8s"),
    (["--train", "time=5"], "argument --train: 'time=5': a range is A..B"),
    (["--train", "when=1..2"], "argument --train: 'when=1..2': expected time=A..B"),
    (["--train", "time=..100"], None),  # ends past the trace are clipped, not an error
    (["--eval", "time=0.."], "--eval time=0s..: starts where run a starts, nothing before it to train on"),
    (["--train", "runs=a,b"], "--train runs=b: no such run in"),
    (["--train", "runs=a", "--run-id", "a"], "--run-id a: not used with runs= windows"),
    (["--train", "forward=10..5"], "argument --train: 'forward=10..5': the range is empty"),
    (["--window-s", "1.5"], "--window-s 1.5: must be a multiple of run a's rollup window (1 s)"),
])
def test_window_errors_are_one_line_naming_the_flag(trace: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                                    args: list[str], message: str | None) -> None:
    code = main(["eplb", str(trace["root"]), *CLUSTER, "--policy", "global", *args])
    err = capsys.readouterr().err
    if message is None:
        assert code == 0, err
        return
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_previous_for_another_cluster_is_refused(trace: dict[str, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.json"
    pl = from_phy2log(np.tile(np.arange(32) % E, (3, 1)), E)
    other.write_text(to_json(pl, Cluster(8, 2, 32, num_groups=4)))
    assert main(["eplb", str(trace["root"]), *CLUSTER, "--previous", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"r3trace eplb: --previous {other}: planned for 8 GPUs / 2 nodes / 32 slots")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(("flags", "says"), [
    (("--policy", "global"), "--keep-groups: a layout of --policy ours; --policy global places by its own rule"),
    (("--dispatch", "static"), "--keep-groups: plans for node-limited dispatch (a token's cover within its groups' "
                               "nodes), not --dispatch static; give --dispatch node-limited"),
    (("--sglang", "SGL"), "--keep-groups: plans for node-limited dispatch (a token's cover within its groups' "
                          "nodes), not --dispatch static (the default with --sglang); give --dispatch node-limited"),
])
def test_keep_groups_refusals(trace: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              flags: tuple[str, ...], says: str) -> None:
    """--keep-groups is ours' layout for node-limited dispatch: another policy or SGLang's dispatch is refused in one
    line, nothing written."""
    sgl = tmp_path / "sgl.json"
    args = [str(sgl) if f == "SGL" else f for f in flags]
    assert main(["eplb", str(trace["root"]), *CLUSTER, "--keep-groups", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"r3trace eplb: {says}"
    assert not sgl.exists()


@pytest.mark.parametrize("cluster, name", [
    # ours spreads on every multi-node cluster (group homes + co-activation replicas, issue 25); groups_on_nodes is
    # --keep-groups (PlannerConfig.keep_groups); expert_per_node (spread_by_affinity off) is not reachable from the CLI
    (Cluster(8, 4, 24, num_groups=4, node_limit=2), "spread"),  # limit 2 < 4 nodes, 4 groups on 4 nodes
    (Cluster(8, 2, 24, num_groups=4, node_limit=4), "spread"),  # limit >= nodes
    (Cluster(8, 8, 24, num_groups=4, node_limit=4), "spread"),  # 4 groups cannot fill 8 nodes
    (Cluster(8, 4, 24, num_groups=4, node_limit=2), "groups_on_nodes"),  # one group a node
    (Cluster(8, 2, 24, num_groups=4, node_limit=4), "groups_on_nodes"),  # two groups a node
])
def test_layout_line_says_what_ours_built(trace: dict[str, Any], capsys: pytest.CaptureFixture[str], cluster: Cluster,
                                          name: str) -> None:
    """The printed layout is the one the placement shows: every expert's first replica on its group's one home node,
    every expert on one node, or groups spread with replicas on several nodes."""
    out = Path(str(trace["root"])).parent / f"layout-{name}-{cluster.num_nodes}.json"
    keep = ("--keep-groups",) if name == "groups_on_nodes" else ()
    lines = run_cli(capsys, str(trace["root"]), "--gpus", "8", "--nodes", str(cluster.num_nodes), "--slots", "24",
                    "--groups", "4", "--node-limit", str(cluster.node_limit), "--policy", "ours", *keep,
                    "--out", str(out))
    [line] = [x for x in lines if x.startswith("layout: ")]
    assert line.startswith(f"layout: {name}: ")
    pl, _ = from_json(out.read_text())
    node_of = np.arange(24) // (24 // cluster.num_nodes)
    nodes_of_expert = [[set(node_of[row == x].tolist()) for x in range(E)] for row in pl.phy2log]  # [L][E]
    [origins] = [x for x in lines if x.startswith("layers: ")]  # contested against hierarchical with groups kept
    assert origins.endswith(f"DeepSeek {'hierarchical' if name == 'groups_on_nodes' else 'global'}'s on the same "
                            "forecast")
    if name == "groups_on_nodes":  # the 4 experts of a group share a home node, 4 / N groups a node
        for layer in nodes_of_expert:
            homes = [set.intersection(*layer[g * 4:(g + 1) * 4]) for g in range(4)]
            assert all(homes), homes
            per_node = np.bincount([min(h) for h in homes], minlength=cluster.num_nodes)
            assert (per_node == 4 // cluster.num_nodes).all(), homes
    elif name == "expert_per_node":
        assert all(len(n) == 1 for layer in nodes_of_expert for n in layer)
    else:
        assert any(len(n) > 1 for layer in nodes_of_expert for n in layer)
    spread = sum(any(len(n) > 1 for n in layer) for layer in nodes_of_expert)
    assert line.endswith(f"; {spread} of 3 layers have an expert with replicas on more than one node")


def test_runs_windows(trace: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--train runs=a,b holds out run c (the run that starts after them); each training run is a history window."""
    root = tmp_path / "runs"
    for i, rid in enumerate("abc"):
        with TraceWriter(root, model_name="m", num_hidden_layers=5, moe_layer_ids=L_IDS, num_experts=E, top_k=K,
                         run_id=rid, num_groups=4) as w:
            part = slice(i * 800, (i + 1) * 800)
            w.append_tokens("r", np.arange(800), "decode", "computed", trace["fwd"][part],
                            trace["ts"][part], 0, trace["ids"][part])
    out = tmp_path / "p.json"
    lines = run_cli(capsys, str(root), *CLUSTER, "--policy", "global", "--forecast", "newest", "--train", "runs=a,b",
                    "--out", str(out))
    assert lines[:2] == ["train: runs=a,b (2 windows), heat from rollups in 2 history windows",
                         "held out: time=0..4s of run c (4 windows)"]  # one run: its time span
    ids = trace["ids"]
    cluster = Cluster(8, 4, 24, num_groups=4, node_limit=2)
    expected = deepseek.global_policy(heat(ids[800:1600]), cluster).phy2log  # newest: run b alone
    pl, _ = from_json(out.read_text())
    np.testing.assert_array_equal(pl.phy2log, expected)
    held = json.loads(out.read_text())["meta"]["report"]["held_out_scores"]
    assert held["balancedness_even"] == pytest.approx(even_balancedness(expected, heat(ids[1600:]), 8), rel=1e-12)


def test_fewer_history_windows_than_asked_say_why(trace: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """A history window is whole rollup windows (1 s here): [0, 2) s holds 2 of --windows 5, and the line says so;
    without --windows the default asks for nothing, so nothing is said; one window is singular."""
    root = str(trace["root"])
    lines = run_cli(capsys, root, *CLUSTER, "--policy", "global", "--train", "time=..2", "--windows", "5")
    assert lines[0] == ("train: time=0..2s of run a (2 windows), heat from rollups in 2 history windows (of --windows "
                        "5: a history window is whole rollup windows, or forwards, and empty ones are dropped)")
    assert run_cli(capsys, root, *CLUSTER, "--policy", "global", "--train", "time=..2")[0].endswith("2 history windows")
    assert run_cli(capsys, root, *CLUSTER, "--policy", "global", "--train", "time=..1")[0].endswith(
        "in 1 history window")


@pytest.mark.parametrize("gpus", [4, 8])
def test_node_copies_where_a_node_holds_every_expert(trace: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                                     gpus: int) -> None:
    """16 slots a node for the 16 experts: the layout line says node_copies. On 4 GPUs (2 a node, top-2) no expert can
    put more than a GPU's mean load on one replica a node, so every layer is the same on both nodes and every token
    reaches one node; on 8 the trace's Zipf(1.1) hottest expert (~27% of picks, 2.2x a GPU's mean over 2 copies)
    sends the layers to the spread layout (node_copies.copy_layers), that expert on more than one replica a node."""
    out = Path(str(trace["root"])).parent / f"layout-node-copies-{gpus}.json"
    lines = run_cli(capsys, str(trace["root"]), "--gpus", str(gpus), "--nodes", "2", "--slots", "32", "--groups", "4",
                    "--policy", "ours", "--out", str(out))
    [line] = [x for x in lines if x.startswith("layout: ")]
    assert line.startswith("layout: node_copies: 16 slots a node hold all 16 experts: every node the same one-node")
    pl, _ = from_json(out.read_text())
    halves = pl.phy2log.reshape(len(pl.phy2log), 2, 16)  # [L, N, P / N]
    copies = (halves[:, 0] == halves[:, 1]).all(1)  # [L]
    [nodes] = [x for x in lines if x.startswith("nodes per token")]
    if gpus == 4:
        assert copies.all() and (pl.logcnt == 2).all()
        assert nodes.split()[3] == "1.000"  # in-sample (the whole trace trains: nothing held out)
    else:
        assert not copies.any()
        assert (pl.logcnt.max(1) > 2).all()
        assert float(nodes.split()[3]) > 1.0
