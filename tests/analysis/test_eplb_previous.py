"""`r3trace eplb --previous FILE`: the placement a cluster runs, read from the JSON `--out` writes or from SGLang's
--init-expert-location file (r3trace/eplb/previous.py), and scored beside the plan, kept as is.

SGLang's file is read as its loader reads it: python/sglang/srt/eplb/expert_location.py at sgl-project/sglang commit
01fec5c2e61f9568c41a6e1d4fd5ac46c88504f1 (compute_initial_expert_location_metadata: a .pt by torch.load, a .json by
json; init_by_mapping: physical_to_logical_map [num_layers][P], rows by real layer id, dense layers included).
Run: .venv/bin/pytest tests/analysis/test_eplb_previous.py -q
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r3trace.cli import main
from r3trace.eplb.placement import from_json
from r3trace.trace import TraceWriter
from tests.analysis.eplb_cli_trace import CLUSTER, L_IDS, E, K, drifting_routes, even_balancedness, heat, run_cli

TOKENS, SECONDS, HIDDEN = 1600, 12, 5
T0 = 1_767_225_600 * 10**9
SCORES = ("balancedness (even split)", "balancedness (replayed)", "balancedness (SGLang static)",
          "balancedness (SGLang dynamic)", "nodes per token", "over node limit (2)", "tokens replayed")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run "a": 1,600 drifting tokens over 12 s (MoE layers 1, 2 and 4 of 5), written by the real TraceWriter."""
    root = tmp_path_factory.mktemp("store")
    ids = drifting_routes(np.random.default_rng(3), TOKENS)
    ts = T0 + (np.arange(TOKENS) * SECONDS * 10**9) // TOKENS
    with TraceWriter(root, model_name="m", num_hidden_layers=HIDDEN, moe_layer_ids=L_IDS, num_experts=E, top_k=K,
                     run_id="a", num_groups=4) as w:
        w.append_tokens([f"r{i % 5}" for i in range(TOKENS)], np.arange(TOKENS), "decode", "computed",
                        np.arange(TOKENS) // 8, ts, 0, ids)
    return {"root": root, "ids": ids, "ts": ts}


def cells(lines: list[str], name: str) -> list[str]:
    """A score row's cells: in-sample, held out, then --previous's in-sample and held out where given."""
    [line] = [x for x in lines if x.startswith(name)]
    return line[len(name):].split()


@pytest.fixture(scope="module")
def live(trace: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DeepSeek global's plan on time=..8, written three ways (--out, --sglang .json and .pt), and its report."""
    d = tmp_path_factory.mktemp("live")
    flags = (str(trace["root"]), *CLUSTER, "--policy", "global", "--train", "time=..8")
    assert main(["eplb", *flags, "--out", str(d / "g.json"), "--sglang", str(d / "s.json")]) == 0
    assert main(["eplb", *flags, "--sglang", str(d / "s.pt")]) == 0
    return {"dir": d, "flags": flags}


@pytest.mark.parametrize("name", ["s.json", "s.pt"])
def test_sglang_file_is_the_same_previous_as_the_json(trace: dict[str, Any], live: dict[str, Any], name: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang's file (rows by real layer id: MoE layers 1, 2 and 4 of 5) gives ours the same previous placement as
    the JSON: every printed line equal but the file's name."""
    d, flags = live["dir"], (str(trace["root"]), *CLUSTER, "--train", "time=..9")
    want = run_cli(capsys, *flags, "--previous", str(d / "g.json"))
    got = run_cli(capsys, *flags, "--previous", str(d / name))
    assert [x.replace(str(d / name), "P") for x in got] == [x.replace(str(d / "g.json"), "P") for x in want]
    assert any(line.startswith("churn vs") for line in got)


def test_previous_is_scored_as_when_it_was_the_plan(trace: dict[str, Any], live: dict[str, Any],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """--previous kept as is scores what the same placement scored as the plan, on the same windows; its held-out
    even split recomputed here with numpy from the rows written (time 8..12 s)."""
    d = live["dir"]
    as_plan = run_cli(capsys, *live["flags"])
    kept = run_cli(capsys, *live["flags"][:-4], "--policy", "ours", "--train", "time=..8", "--previous",
                   str(d / "s.json"))
    for name in SCORES:
        plan_cells, kept_cells = cells(as_plan, name), cells(kept, name)
        assert len(plan_cells) == 2 and len(kept_cells) == 4
        assert kept_cells[2:] == plan_cells, name
    pl, _ = from_json((d / "g.json").read_text())
    held = trace["ids"][trace["ts"] >= T0 + 8 * 10**9]
    assert cells(kept, SCORES[0])[3] == f"{even_balancedness(pl.phy2log, heat(held), 8):.4f}"
    header = [x for x in kept if x.strip().startswith("in-sample")]
    assert header and header[0].rstrip().endswith("--previous, kept as is")
    out = d / "ours.json"
    run_cli(capsys, *live["flags"][:-4], "--policy", "ours", "--train", "time=..8", "--previous", str(d / "g.json"),
            "--out", str(out))
    report = json.loads(out.read_text())["meta"]["report"]
    assert f"{report['previous_held_out']['balancedness_even']:.4f}" == cells(kept, SCORES[0])[3]
    plan, was = report["held_out_scores"], report["previous_held_out"]
    assert kept[-1] == (f"re-plan vs keeping --previous, held out, node-limited: balancedness "
                        f"{plan['balancedness_replay'] - was['balancedness_replay']:+.4f}, nodes per token "
                        f"{plan['nodes_per_token'] - was['nodes_per_token']:+.3f}")


def _sglang(path: Path, table: Any) -> Path:
    path.write_text(json.dumps({"physical_to_logical_map": table}))
    return path


@pytest.mark.parametrize("bad, message", [
    (lambda m: m[:, :20], "physical_to_logical_map has 20 slots a layer; --slots is 24"),
    (lambda m: m[:3], "physical_to_logical_map has 3 layers; the trace's model has 5"),
    (lambda m: np.where(m == 7, 0, m), "physical_to_logical_map row 1 (a MoE layer): expert 7 of 0..15 has no slot"),
    (lambda m: np.where(m == 7, 16, m), "row 1 (a MoE layer): slot 7 holds expert 16, outside 0..15"),
    (lambda m: m + 0.5, "physical_to_logical_map must be [layers][slots] integers"),
    (lambda m: [list(r) for r in m[:, :23]] + [list(m[0])], "physical_to_logical_map must be [layers][slots]"),
])
def test_a_bad_sglang_file_is_refused_in_one_line(trace: dict[str, Any], live: dict[str, Any], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str], bad: Any, message: str) -> None:
    full = np.asarray(json.loads((live["dir"] / "s.json").read_text())["physical_to_logical_map"])
    table = bad(full)
    path = _sglang(tmp_path / "bad.json", table.tolist() if isinstance(table, np.ndarray) else
                   [[int(x) for x in r] for r in table])
    assert main(["eplb", str(trace["root"]), *CLUSTER, "--previous", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"r3trace eplb: --previous {path}: ") and message in err


def test_a_file_of_neither_kind_is_refused(trace: dict[str, Any], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"logical_count": [[1, 2]]}))  # SGLang's other --init-expert-location: not a placement
    assert main(["eplb", str(trace["root"]), *CLUSTER, "--previous", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "neither a placement JSON written by --out" in err
    assert "['logical_count']" in err


def test_recorded_is_the_map_in_force_at_the_training_windows_end(trace: dict[str, Any], live: dict[str, Any],
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """--previous recorded reads the trace's placements table (an engine's, written here by the real TraceWriter): a
    shuffle from forward 0, global's plan for layers 2 and 4 from forward 100 and for layer 1 from forward 150. With
    --train time=..9 (forwards ..149) the cluster ran the shuffle on layer 1 and the plan on the others when the plan
    was made: every line equals --previous given that map as SGLang's file, but the label; with the whole run as
    training window, the plan on every layer: --previous g.json's lines. A run without placements, or another slot
    count, is refused in one line."""
    pl, _ = from_json((live["dir"] / "g.json").read_text())
    shuffle = np.stack([np.random.default_rng(i).permutation(np.arange(24) % E) for i in range(len(L_IDS))])
    with TraceWriter(tmp_path, model_name="m", num_hidden_layers=HIDDEN, moe_layer_ids=L_IDS, num_experts=E, top_k=K,
                     run_id="a", num_groups=4, parallel={"ep_size": 8}) as w:
        w.add_placement(0, L_IDS, shuffle)
        w.append_tokens([f"r{i % 5}" for i in range(TOKENS)], np.arange(TOKENS), "decode", "computed",
                        np.arange(TOKENS) // 8, trace["ts"], 0, trace["ids"])
        w.add_placement(100, L_IDS[1:], pl.phy2log[1:])
        w.add_placement(150, L_IDS[:1], pl.phy2log[:1])
    end = int(np.flatnonzero(trace["ts"] < T0 + 9 * 10**9)[-1]) // 8  # the training window's newest forward
    assert end == 149
    ran = np.tile(np.arange(24) % E, (HIDDEN, 1))  # SGLang's rows: every layer, dense ones trivial
    ran[list(L_IDS)] = np.concatenate([shuffle[:1], pl.phy2log[1:]])
    (tmp_path / "ran.json").write_text(json.dumps({"physical_to_logical_map": ran.tolist()}))
    flags = (*CLUSTER, "--train", "time=..9")
    want = run_cli(capsys, str(trace["root"]), *flags, "--previous", str(tmp_path / "ran.json"))
    got = run_cli(capsys, str(tmp_path), *flags, "--previous", "recorded")
    label = "run a's recorded placement at forward 149"
    assert got == [x.replace(str(tmp_path / "ran.json"), label) for x in want]
    assert any(line.startswith(f"churn vs {label}: ") for line in got)
    whole = (*CLUSTER, "--train", "time=..12")
    want = run_cli(capsys, str(trace["root"]), *whole, "--previous", str(live["dir"] / "g.json"))
    got = run_cli(capsys, str(tmp_path), *whole, "--previous", "recorded")
    assert got == [x.replace(str(live["dir"] / "g.json"), "run a's recorded placement at forward 199") for x in want]

    assert main(["eplb", str(trace["root"]), *CLUSTER, "--previous", "recorded"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("r3trace eplb: --previous recorded: run a records no expert placement (an r3trace engine writes "
                   "one when a trace starts)")
    assert main(["eplb", str(tmp_path), "--gpus", "4", "--nodes", "2", "--slots", "24", "--previous", "recorded"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("r3trace eplb: --previous recorded: run a ran 24 slots on ep_size=8; this plan is for 24 slots on 4 "
                   "GPUs")
