"""Every ingest path keeps time: numpy timestamps and window ids round-trip into the routes' ts and the rollups'
windows; response bodies take their `created` (SGLang's OpenAI protocol sets it to int(time.time()):
python/sglang/srt/entrypoints/openai/protocol.py at sgl-project/sglang commit
004c82e07d876f6e4a0ad6e15325706b0f478f1a, CompletionResponse.created) and their line number as forward_id; a
/generate body without one gets the ingest time; an expert-distribution dump the time in the name SGLang gives it
(expert_distribution_recorder_{time.time()}.pt, python/sglang/srt/eplb/expert_distribution.py at commit
02295fe5ac5ccff3e8829800d50450351c56fb53, _StatAccumulator.dump), else its modification time.

Run: .venv/bin/pytest tests/analysis/test_ingest_time.py -q
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest

from r3trace.analysis.ingest import IngestError, ModelShape, ingest_responses
from r3trace.analysis.ingest_numpy import ingest_numpy
from r3trace.cli import main
from tests.analysis.test_ingest_peers import raw_b64, sglang_completion

SHAPE = ModelShape(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=16, top_k=2)
SHAPE_FLAGS = ("--num-hidden-layers", "4", "--first-k-dense", "1", "--num-experts", "16", "--top-k", "2",
               "--num-groups", "4")
T, PER_FORWARD = 12, 4  # 3 forwards of 4 tokens
NS = 10**9


def routes_table(store: Path, run_id: str) -> dict[str, np.ndarray]:
    """The run's rows at its first MoE layer, by token_pos: ts (ns) and forward_id, read with plain pyarrow."""
    t = ds.dataset(store / "routes" / f"run_id={run_id}").to_table(columns=["token_pos", "ts", "forward_id",
                                                                             "layer_id"])
    t = t.filter(ds.field("layer_id") == 1).sort_by("token_pos")
    return {"ts": t.column("ts").cast("int64").to_numpy(), "forward_id": t.column("forward_id").to_numpy()}


def rollup_windows(store: Path, run_id: str) -> dict[int, int]:
    """window_start (ns) -> count summed over layers and experts."""
    t = ds.dataset(store / "rollups" / f"run_id={run_id}").to_table(columns=["window_start", "count"])
    out: dict[int, int] = {}
    for w, c in zip(t.column("window_start").cast("int64").to_pylist(), t.column("count").to_pylist(), strict=True):
        out[w] = out.get(w, 0) + c
    return out


def npz(path: Path, **extra: np.ndarray) -> Path:
    ids = np.argsort(np.random.default_rng(0).random((T, 3, 16)), axis=-1)[..., :2]  # 2 distinct experts a layer
    arrays = {"topk_ids": ids, "forward_id": np.arange(T) // PER_FORWARD, **extra}
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def test_numpy_timestamps_and_window_ids_round_trip(tmp_path: Path) -> None:
    store = tmp_path / "store"
    per_token = 1_767_225_600 * NS + np.arange(T) * 250_000_000  # ns since the epoch, 4 a second
    m = ingest_numpy(npz(tmp_path / "a.npz", ts=per_token), store, SHAPE, run_id="tok", progress=False)
    assert m.engine["ts_from"] == "ts per token"
    got = routes_table(store, "tok")
    np.testing.assert_array_equal(got["ts"], per_token)
    np.testing.assert_array_equal(got["forward_id"], np.arange(T) // PER_FORWARD)
    assert rollup_windows(store, "tok") == {1_767_225_600 * NS + s * NS: 4 * 3 * 2 for s in range(3)}

    seconds = np.array([10.5, 11.25, 12.0])  # one per forward, float seconds since the epoch
    ingest_numpy(npz(tmp_path / "b.npz", ts=seconds), store, SHAPE, run_id="fwd", progress=False)
    np.testing.assert_array_equal(routes_table(store, "fwd")["ts"], np.repeat([10_500_000_000, 11_250_000_000,
                                                                               12 * NS], PER_FORWARD))
    windows = np.array([0, 0, 0, 0, 5, 5, 5, 5, 5, 5, 9, 9])  # per token: window w is rollup window w (1 s)
    m = ingest_numpy(npz(tmp_path / "c.npz"), store, SHAPE, run_id="win", progress=False, window_id=windows)
    assert m.engine["ts_from"] == "window_id per token"
    np.testing.assert_array_equal(routes_table(store, "win")["ts"], windows * NS)
    assert rollup_windows(store, "win") == {0: 4 * 6, 5 * NS: 6 * 6, 9 * NS: 2 * 6}

    before = time.time_ns()
    m = ingest_numpy(npz(tmp_path / "d.npz"), store, SHAPE, run_id="none", progress=False)
    got = routes_table(store, "none")
    assert m.engine["ts_from"] == "ingest time (no ts or window_id given)"
    assert len(set(got["ts"].tolist())) == 1 and before <= got["ts"][0] <= time.time_ns()


def test_numpy_ts_file_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stamps = np.datetime64("2026-01-01T00:00:00", "ns") + np.arange(T) * np.timedelta64(300, "ms")
    np.save(tmp_path / "ts.npy", stamps)
    args = ["ingest", str(npz(tmp_path / "a.npz")), "--store", str(tmp_path / "s"), "--format", "numpy",
            "--run-id", "a", *SHAPE_FLAGS]
    assert main([*args, "--ts", str(tmp_path / "ts.npy")]) == 0
    assert capsys.readouterr().out.strip() == f"run a: routes, {T * 3} rows; time from ts per token"
    np.testing.assert_array_equal(routes_table(tmp_path / "s", "a")["ts"], stamps.astype(np.int64))
    # the trace now has time: a plan holds out what follows its training window
    assert main(["eplb", str(tmp_path / "s"), "--gpus", "4", "--nodes", "2", "--slots", "16", "--policy", "global",
                 "--train", "time=..2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["train: time=0..2s of run a (2 windows), heat from rollups in 2 history windows",
                       "held out: time=2..4s of run a (2 windows)"]


@pytest.mark.parametrize("extra, message", [
    ({"ts": np.arange(5)}, "field ts has 5 entries; expected T=12 (one per token) or F=3 (one per distinct "
                           "forward_id)"),
    ({"ts": np.array([1.0, np.nan, 2.0])}, "field ts holds NaN or inf"),
    ({"window_id": np.array([0, -1, 2])}, "field window_id holds -1; window ids are >= 0"),
    ({"window_id": np.array([0.5, 1.0, 2.0])}, "field window_id is float64; expected integers"),
    ({"ts": np.arange(T), "window_id": np.arange(T)}, "give ts or window_id, not both"),
])
def test_numpy_time_errors_name_the_field_and_leave_nothing(tmp_path: Path, extra: dict[str, np.ndarray],
                                                           message: str) -> None:
    store = tmp_path / "store"
    store.mkdir()
    with pytest.raises(IngestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ingest_numpy(npz(tmp_path / "bad.npz", **extra), store, SHAPE, progress=False)
    assert list(store.iterdir()) == []


def test_time_flags_outside_numpy_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "ts.npy", np.arange(T))
    (tmp_path / "r.jsonl").write_text("{}\n")
    for args, message in [
        (["--format", "sglang", "--ts", str(tmp_path / "ts.npy")], f"--ts {tmp_path / 'ts.npy'}: only with --format "
                                                                  "numpy"),
        (["--format", "numpy", "--ts", "a.npy", "--window-ids", "b.npy"], "--ts a.npy --window-ids b.npy: give one"),
    ]:
        assert main(["ingest", str(tmp_path / "r.jsonl"), "--store", str(tmp_path / "s"), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_response_bodies_keep_created_and_line_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    a = np.argsort(rng.random((5, 4, 16)), axis=-1)[..., :2]  # 2 distinct experts a layer
    a[:, 0] = 0
    b = a.copy()
    openai = sglang_completion("ra", a, 3, 3)
    openai["created"] = 1_767_225_601  # Unix seconds, as SGLang's and vLLM's OpenAI servers set it
    generate = {"text": "x", "meta_info": {"id": "rb", "routed_experts": raw_b64(b), "prompt_tokens": 3,
                                           "completion_tokens": 3}}  # /generate: no created
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps(openai) + "\n\n" + json.dumps(generate) + "\n")
    before = time.time_ns()
    ingest_responses(src, tmp_path / "s", SHAPE, run_id="r", progress=False)
    t = ds.dataset(tmp_path / "s" / "routes" / "run_id=r").to_table().to_pandas()
    ra, rb = t[t.request_id == "ra"], t[t.request_id == "rb"]
    assert set(ra.ts.astype("int64")) == {1_767_225_601 * NS} and set(ra.forward_id) == {1}  # line 1
    assert set(rb.forward_id) == {3}  # line 3 (line 2 is blank)
    [stamp] = set(rb.ts.astype("int64"))
    assert before <= stamp <= time.time_ns()


def test_expert_distribution_dump_keeps_its_time(tmp_path: Path) -> None:
    import torch

    from r3trace.analysis.ingest_dump import ingest_expert_distribution

    counts = torch.from_numpy(np.random.default_rng(3).integers(0, 9, (2, 4, 16)))
    named = tmp_path / "expert_distribution_recorder_1767225600.75.pt"  # SGLang's name: time.time() at the dump
    torch.save({"logical_count": counts}, named)
    ingest_expert_distribution(named, tmp_path / "s", SHAPE, run_id="named")
    assert set(rollup_windows(tmp_path / "s", "named")) == {1_767_225_600 * NS}  # the 1 s window holding it
    other = tmp_path / "dump.pt"
    torch.save({"logical_count": counts}, other)
    os.utime(other, ns=(1_000 * NS + 1, 1_000 * NS + 1))
    ingest_expert_distribution(other, tmp_path / "s", SHAPE, run_id="mtime")
    assert set(rollup_windows(tmp_path / "s", "mtime")) == {1_000 * NS}
