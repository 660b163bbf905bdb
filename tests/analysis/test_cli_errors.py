"""`r3trace` errors as a user meets them: one line on stderr that names the path or flag, exit 2, no traceback;
`--debug` (before or after the command) adds the traceback. Every case runs the CLI as a real process.

Run: .venv/bin/pytest -q tests/analysis/test_cli_errors.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from r3trace.cli import main, report
from tests.analysis.cli_stores import SAMPLES, broken_store, cli, small_store

EPLB = ("--gpus", "4", "--nodes", "2", "--slots", "16")


def one_line(proc: subprocess.CompletedProcess[str], *needles: str, code: int = 2) -> str:
    """The single stderr line of a failed command, checked for every needle."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_store(tmp_path_factory.mktemp("store"))


def test_missing_path_says_does_not_exist(tmp_path: Path) -> None:
    line = one_line(cli("stats", "nope", cwd=tmp_path), "r3trace stats: store", str(tmp_path / "nope"),
                    "does not exist")
    assert "not a folder" not in line


def test_a_file_where_a_folder_is_expected(store: Path) -> None:
    manifest = store / "run_id=a" / "manifest.json"
    one_line(cli("sql", "select 1", "--store", str(manifest), cwd=store),
             f"store {manifest} is a run's manifest, not a folder", f"give the folder that holds it: {manifest.parent}")


@pytest.mark.parametrize("how, needles", [
    ("corrupt_manifest", ("manifest.json unreadable", "fix that file, or move")),
    ("wrong_schema", ("manifest.json: manifest has unknown fields ['layers']", "fix that file, or move")),
])
def test_bad_manifest_names_the_file(store: Path, tmp_path: Path, how: str, needles: tuple[str, ...]) -> None:
    bad = broken_store(store, tmp_path / how, how)
    one_line(cli("stats", str(bad), cwd=tmp_path), str(bad / "run_id=a" / "manifest.json"), *needles)


def test_corrupt_parquet_names_the_file(store: Path, tmp_path: Path) -> None:
    bad = broken_store(store, tmp_path / "torn", "corrupt_parquet")
    one_line(cli("eplb", str(bad), *EPLB, cwd=tmp_path), "r3trace eplb:",
             str(bad / "routes" / "run_id=a" / "part-00000.parquet"), "missing or damaged")


def test_sql_typo_and_refused_statement(store: Path) -> None:
    one_line(cli("sql", "SELEC 1", "--store", str(store), cwd=store), 'Parser Error: syntax error at or near "SELEC"')
    one_line(cli("sql", "select * from routez", "--store", str(store), cwd=store),
             "Table with name routez does not exist", 'Did you mean "routes"')
    out = store / "x.csv"
    one_line(cli("sql", f"copy (select 1) to '{out}'", "--store", str(store), cwd=store),
             "statement type COPY refused", "rerun with --trusted")
    assert not out.exists()


@pytest.mark.parametrize("args, needles", [
    (["eplb", "S", "--gpus", "x", "--nodes", "2", "--slots", "16"], ["r3trace eplb: argument --gpus: invalid int"]),
    (["eplb", "S", "--gpus", "4", "--nodes", "2", "--slots", "18"],
     ["--gpus 4 --nodes 2 --slots 18: num_slots=18 is not a multiple of num_gpus=4"]),
    (["eplb", "S", "--gpus", "4", "--nodes", "2", "--slots", "8"],
     ["fewer slots than run a's 16 experts", "--slots >= 16"]),
    (["eplb", "S", *EPLB, "--run-id", "b"], ["--run-id b: no such run in", "(runs: a)"]),
    (["eplb", "S", *EPLB, "--sglang", "loc.txt"],
     ["--sglang loc.txt: must end in .json or .pt", "parses any other value as inline JSON"]),
    (["eplb", "S", *EPLB, "--groups", "3"], ["--groups 3: does not divide run a's 16 experts"]),
    (["eplb", "S", *EPLB, "--out", "no/such/p.json"], ["--out no/such/p.json: folder no/such does not exist"]),
    (["eplb", "S", *EPLB, "--out", "S"], ["is a folder; give a file path"]),
    (["eplb", "S", *EPLB, "--windows", "4", "--window-s", "1"], ["--windows 4 --window-s 1: give one"]),
    (["synth", "S", "--tokens", "0"], ["r3trace synth: argument --tokens: 0 must be >= 1"]),
    (["eplb", "S", "--gpus", "4"], ["the following arguments are required: --nodes, --slots"]),
    (["stats", "S", "--progress", "loud"], ["argument --progress: invalid choice: 'loud'"]),
    (["sql", "select * from routes", "--store", "S", "--format", "csv"],
     ["--format csv: column(s) topk_ids hold lists, which CSV cannot"]),
])
def test_bad_flag_values(store: Path, args: list[str], needles: list[str]) -> None:
    one_line(cli(*[str(store) if a == "S" else a for a in args], cwd=store), *needles)


@pytest.mark.parametrize("command", [
    ["stats", "D"], ["sql", "select 1", "--store", "D"], ["eplb", "D", *EPLB], ["diff", "D", "D"],
    ["replay-check", "D", "--model", str(SAMPLES / "model")], ["ingest", "D", "--store", "OUT"],
])
def test_empty_store_says_so(tmp_path: Path, command: list[str]) -> None:
    (tmp_path / "D").mkdir()
    args = [str(tmp_path / a) if a in ("D", "OUT") else a for a in command]
    one_line(cli(*args, cwd=tmp_path), f"r3trace {command[0]}: no r3trace runs under {tmp_path / 'D'} "
             "(expected run_id=*/manifest.json)")
    assert not (tmp_path / "OUT").exists()


def test_foreign_store_lists_what_it_found(tmp_path: Path) -> None:
    for name in ("a.csv", "b.json", "c.txt", "d.parquet"):
        (tmp_path / name).write_text("x")
    (tmp_path / "run_id=w").mkdir()  # a run whose writer has not written its manifest yet
    one_line(cli("stats", str(tmp_path), cwd=tmp_path), f"no r3trace runs under {tmp_path}",
             "1 run_id=* folders have no manifest.json yet",
             "found other entries: a.csv, b.json, c.txt, ... (4 in all)")


def test_replay_check_model_path_and_run(store: Path, tmp_path: Path) -> None:
    traces = str(SAMPLES / "traces")
    one_line(cli("replay-check", traces, "--model", str(tmp_path / "m"), cwd=tmp_path),
             f"--model {tmp_path / 'm'} does not exist")
    one_line(cli("replay-check", traces, "--model", traces, cwd=tmp_path), f"--model {traces} has no config.json")
    one_line(cli("replay-check", str(store), "--model", str(SAMPLES / "model"), cwd=tmp_path),
             "no request keeps its token ids")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_prints_the_traceback(tmp_path: Path, where: str) -> None:
    args = ["--debug", "stats", "nope"] if where == "before" else ["stats", "nope", "--debug"]
    proc = cli(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr and "StoreError" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("r3trace stats: store") and "does not exist" in proc.stderr


def test_internal_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A bug (not a user error) is one line too, says so and points at --debug; exit 1."""
    assert report(RuntimeError("boom\nsecond line"), "r3trace x", debug=False) == 1
    assert capsys.readouterr().err == \
        "r3trace x: internal error: RuntimeError: boom; rerun with --debug for the traceback\n"
    assert report(ZeroDivisionError("d"), "r3trace x", debug=True) == 1
    err = capsys.readouterr().err
    assert err.startswith("ZeroDivisionError: d") and err.endswith("r3trace x: internal error: ZeroDivisionError: d\n")


def test_main_returns_the_code_in_process(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """main() (what tests and the console script call) returns the code instead of raising."""
    assert main(["stats", str(store / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["sql", "select count(*) as n from routes", "--store", str(store), "--format", "csv"]) == 0
    assert capsys.readouterr().out == "n\n180\n"  # 3 requests x 20 tokens x 3 MoE layers


def test_store_commands_start_without_torch(store: Path) -> None:
    """`r3trace --help` and the store commands import no torch, fastapi or engine (seconds per call saved)."""
    code = ("import sys; from r3trace.cli import build_parser, main; build_parser(); "
            f"assert main(['stats', {str(store)!r}]) == 0; "
            "print(sorted(m for m in ('torch', 'fastapi', 'r3trace.engine') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=store, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


def test_store_errors_stay_value_errors(tmp_path: Path) -> None:
    """TraceStore raised TraceSchemaError (a ValueError) for a bad path; callers catching ValueError still work."""
    from r3trace.analysis.store import TraceStore, open_store

    with pytest.raises(ValueError, match="does not exist"):
        TraceStore(tmp_path / "nope")
    with pytest.raises(ValueError, match="no r3trace runs under"):
        open_store(tmp_path)


def test_output_folder_that_is_a_file(tmp_path: Path) -> None:
    """ingest --store and synth's folder take a dataset folder (created when missing); a file there is refused
    naming the flag, before anything is written (it failed on the staging folder, naming neither)."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "b.jsonl").write_text('{"meta_info": {"routed_experts": "AAAA"}}\n')
    one_line(cli("ingest", "b.jsonl", "--store", "afile", "--format", "responses", cwd=tmp_path),
             "r3trace ingest: --store afile is a file; give a dataset folder")
    one_line(cli("synth", "afile", "--tokens", "8", cwd=tmp_path), "r3trace synth: out afile is a file")
    assert (tmp_path / "afile").read_text() == "x"
