"""Tokens whose top-K repeats an expert (all-zero rows): ingest refuses them, or with --drop-repeated leaves them
out; `r3trace stats` counts them in a trace written otherwise.

SGLang: python/sglang/srt/layers/topk_capturer_base.py at sgl-project/sglang commit
e9680922582b1858b165fd7179ab413cb57e8f6e: BaseHostCache's buffer is torch.zeros([num_tokens, num_layers, K]), a
forward writes host_cache.buffer[out_cache_loc] only, and get_topk answers a request with
buffer[req_to_token[req][:seqlen - 1]]: rows indexed by KV slot, so a slot no forward wrote comes back as [0] * K
on every layer (routed_experts_capturer.py builds on it; the copy in shared/seeds/routed_experts.py.txt too). A
router picks K distinct experts (its top-k), so such a row is told apart from a real one by the repeat, never by
the value 0 (expert 0 is a real expert).
Run: .venv/bin/pytest tests/analysis/test_repeated_experts.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pybase64
import pytest

from r3trace.analysis.ingest import IngestError, ModelShape, ingest_responses
from r3trace.analysis.ingest_numpy import ingest_numpy
from r3trace.analysis.integrity import Repeated, repeated_rows
from r3trace.analysis.store import TraceStore
from r3trace.cli import main
from r3trace.trace.batch import repeated_experts
from r3trace.trace.reader import open_dataset
from r3trace.trace.writer import TraceWriter

SHAPE = ModelShape(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=16, top_k=2)
FLAGS = ["--num-hidden-layers", "4", "--first-k-dense", "1", "--num-experts", "16", "--top-k", "2"]


def distinct(rng: np.random.Generator, shape: tuple[int, ...], experts: int = 16, k: int = 2) -> np.ndarray:
    """[*shape, K] ids, K distinct experts a row, as a router picks them (expert 0 among them)."""
    return np.argsort(rng.random((*shape, experts)), axis=-1)[..., :k].astype(np.int32)


def generate_body(rid: str, full: np.ndarray, prompt: int) -> dict:
    """An SGLang /generate body: meta_info.routed_experts = the flat int32 [rows, layers, K] bytes, base64."""
    return {"text": "x", "meta_info": {"id": rid, "prompt_tokens": prompt, "completion_tokens": len(full) + 1 - prompt,
                                       "routed_experts": pybase64.b64encode(full.astype("<i4").tobytes()).decode()}}


def broken_bodies(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """Two requests; request b's KV slots 2 and 5 never captured (all zeros, dense layer 0 too), and one token of
    a that picks expert 0 once (a real row). -> (file, b's rows [7, 4, 2], b's positions kept)."""
    rng = np.random.default_rng(31)
    a, b = distinct(rng, (4, 4)), distinct(rng, (7, 4))
    a[:, 0] = b[:, 0] = 0  # dense layer 0: SGLang writes 0
    a[1, 2] = [0, 9]
    b[[2, 5]] = 0
    src = tmp_path / "bodies.jsonl"
    src.write_text(json.dumps(generate_body("a", a, 2)) + "\n" + json.dumps(generate_body("b", b, 3)) + "\n")
    return src, b, np.array([0, 1, 3, 4, 6])


def test_repeated_experts_marks_rows_naming_an_expert_twice() -> None:
    ids = np.array([[[0, 1], [0, 0]], [[5, 3], [3, 5]], [[7, 7], [2, 7]]])  # [T=3, L=2, K=2]
    np.testing.assert_array_equal(repeated_experts(ids), [[False, True], [False, False], [True, False]])
    wide = np.array([[4, 1, 9, 1], [4, 1, 9, 2]])  # a repeat away from its neighbour in gate order
    np.testing.assert_array_equal(repeated_experts(wide), [True, False])
    assert not repeated_experts(np.array([[3], [3]])).any()  # top-1 cannot repeat


def test_all_zero_rows_refused_naming_line_token_and_layer(tmp_path: Path) -> None:
    src, _, _ = broken_bodies(tmp_path)
    store = tmp_path / "store"
    with pytest.raises(IngestError, match=r"bodies.jsonl:2: field meta_info.routed_experts repeats expert 0 in "
                                          r"token 2's top-2 on MoE layer 0 \(of 3; model layer 1\): a router picks 2 "
                                          r"distinct experts; 2 of 7 tokens here repeat one, 2 of them all zeros"):
        ingest_responses(src, store, SHAPE, run_id="r")
    assert list(store.iterdir()) == []  # all-or-nothing: request a's rows did not land either


def test_drop_repeated_keeps_every_other_token_at_its_position(tmp_path: Path) -> None:
    src, b, kept = broken_bodies(tmp_path)
    m = ingest_responses(src, tmp_path / "store", SHAPE, run_id="r", drop_repeated=True)
    assert m.rows == (4 + 5) * 3 and m.engine["dropped_repeated_tokens"] == 2
    assert open_dataset(tmp_path / "store")[0].manifest.engine["dropped_repeated_tokens"] == 2  # on disk too
    got = TraceStore(tmp_path / "store").query("select token_pos, layer_id, topk_ids, phase from routes "
                                               "where request_id = 'b' order by token_pos, layer_id")
    np.testing.assert_array_equal(np.asarray(got["token_pos"].to_list()[::3]), kept)
    np.testing.assert_array_equal(np.stack(got["topk_ids"].to_list()).reshape(5, 3, 2), b[kept][:, 1:])
    assert got["phase"].to_list()[::3] == ["prefill", "prefill", "decode", "decode", "decode"]  # prompt of 3


def test_cli_one_line_error_then_drop_repeated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, _, _ = broken_bodies(tmp_path)
    cmd = ["ingest", str(src), "--store", str(tmp_path / "store"), "--format", "responses", "--run-id", "r", *FLAGS]
    assert main(cmd) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and "--drop-repeated ingests the others" in err[0]
    assert main([*cmd, "--drop-repeated"]) == 0
    assert "run r: routes, 27 rows; time from" in (out := capsys.readouterr().out)
    assert out.strip().endswith("left out 2 tokens repeating an expert (--drop-repeated)")
    assert main(["ingest", str(tmp_path / "store"), "--store", str(tmp_path / "s2"), "--drop-repeated"]) == 2
    assert "--drop-repeated: only for response bodies and numpy" in capsys.readouterr().err


def test_numpy_drop_repeated_across_slices(tmp_path: Path) -> None:
    """Tokens 3 and 16,388 (the second 16,384-token slice) repeat: left out, every other token kept with its own
    token_pos, forward_id and ts; a file of nothing but repeats is refused."""
    rng = np.random.default_rng(32)
    t = 16_390
    ids = distinct(rng, (t, 3))
    ids[3, 2] = [5, 5]
    ids[16_388] = 0
    ts = 1_700_000_000_000_000_000 + np.arange(t) * 1_000_000
    np.savez(tmp_path / "a.npz", topk_ids=ids, ts=ts, forward_id=np.arange(t) // 4)
    m = ingest_numpy(tmp_path / "a.npz", tmp_path / "store", SHAPE, run_id="n", drop_repeated=True)
    keep = np.setdiff1d(np.arange(t), [3, 16_388])
    assert m.rows == len(keep) * 3 and m.engine["dropped_repeated_tokens"] == 2
    got = TraceStore(tmp_path / "store").query("select token_pos, forward_id, epoch_ns(ts) as ns, topk_ids from routes "
                                               "where layer_id = 2 order by token_pos")
    np.testing.assert_array_equal(np.asarray(got["token_pos"].to_list()), keep)
    np.testing.assert_array_equal(np.asarray(got["forward_id"].to_list()), keep // 4)
    np.testing.assert_array_equal(np.asarray(got["ns"].to_list()), ts[keep])
    np.testing.assert_array_equal(np.stack(got["topk_ids"].to_list()), ids[keep, 1])
    np.savez(tmp_path / "z.npz", topk_ids=np.zeros((5, 3, 2), dtype=np.int32))
    with pytest.raises(IngestError, match=r"z.npz: --drop-repeated left out all 5 tokens"):
        ingest_numpy(tmp_path / "z.npz", tmp_path / "store", SHAPE, run_id="z", drop_repeated=True)
    assert [r.manifest.run_id for r in TraceStore(tmp_path / "store").runs] == ["n"]


def test_stats_counts_repeats_in_a_trace_the_writer_took(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The writer's per-forward check leaves the sort out (trace/batch.py), so a capture with unwritten slots
    lands; stats counts its rows: 2 all-zero tokens x 3 layers, and one [5, 5] row."""
    rng = np.random.default_rng(33)
    ids = distinct(rng, (10, 3))
    ids[[4, 7]] = 0
    ids[2, 1] = [5, 5]
    ids[8, 0] = [0, 3]  # expert 0 picked once: a real row
    with TraceWriter(tmp_path / "t", model_name="m", num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=16,
                     top_k=2, run_id="w", flush_interval_s=None) as w:
        w.append_tokens("q", np.arange(10), "decode", "computed", np.arange(10), 1_700_000_000_000_000_000, 0, ids)
    s = TraceStore(tmp_path / "t")
    assert repeated_rows(s.con, "w") == Repeated(rows=7, all_zero=6, total=30)
    assert main(["stats", str(tmp_path / "t")]) == 0
    assert "rows repeating an expert in their top-2: 7 of 30 (6 all zeros" in capsys.readouterr().out


def test_repeated_rows_finds_a_repeat_at_any_two_positions_of_a_wider_top_k(tmp_path: Path) -> None:
    """top-4: repeats at every pair of positions (adjacent or not), rows of K zeros, expert 0 picked once; the counts
    equal numpy's over the same rows, and a top-1 run counts none."""
    rng = np.random.default_rng(35)
    ids = distinct(rng, (24, 3), k=4)  # [T, L, 4]
    pairs = [(i, j) for i in range(4) for j in range(i + 1, 4)]
    for t, (i, j) in enumerate(pairs):  # six tokens, one pair each, on layer t % 3
        ids[t, t % 3, j] = ids[t, t % 3, i]
    ids[[9, 15]] = 0  # two tokens never written: K zeros on every layer
    ids[20, 1] = [0, 3, 7, 11]  # expert 0 once: a real row
    with TraceWriter(tmp_path / "t", model_name="m", num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=16,
                     top_k=4, run_id="w", flush_interval_s=None) as w:
        w.append_tokens("q", np.arange(24), "decode", "computed", np.arange(24), 1_700_000_000_000_000_000, 0, ids)
    rows = ids.reshape(-1, 4)
    want = int((np.sort(rows, axis=1)[:, 1:] == np.sort(rows, axis=1)[:, :-1]).any(1).sum())
    assert want == 6 + 6
    assert repeated_rows(TraceStore(tmp_path / "t").con, "w") == Repeated(rows=want, all_zero=6, total=72)
    with TraceWriter(tmp_path / "one", model_name="m", num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=16,
                     top_k=1, run_id="o", flush_interval_s=None) as w:
        w.append_tokens("q", np.arange(5), "decode", "computed", np.arange(5), 1_700_000_000_000_000_000, 0,
                        np.zeros((5, 3, 1), dtype=np.int32))
    assert repeated_rows(TraceStore(tmp_path / "one").con, "o") == Repeated(rows=0, all_zero=0, total=15)


def test_eplb_warns_of_repeats_in_the_tokens_it_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """3 of 40 tokens all zeros, in the training window: `r3trace eplb` says so on the line after the windows;
    the same trace without them prints no warning."""
    rng = np.random.default_rng(34)
    ids = distinct(rng, (40, 3))
    for name, broken in (("clean", []), ("zeros", [5, 17, 30])):
        ids_run = ids.copy()
        ids_run[broken] = 0
        with TraceWriter(tmp_path / name, model_name="m", num_hidden_layers=4, moe_layer_ids=(1, 2, 3),
                         num_experts=16, top_k=2, run_id=name, flush_interval_s=None) as w:
            w.append_tokens("q", np.arange(40), "decode", "computed", np.arange(40),
                            1_700_000_000_000_000_000 + np.arange(40) * 100_000_000, 0, ids_run)
    flags = ["--gpus", "4", "--nodes", "2", "--slots", "16", "--policy", "ours"]
    assert main(["eplb", str(tmp_path / "clean"), *flags]) == 0
    assert "warning" not in capsys.readouterr().out
    assert main(["eplb", str(tmp_path / "zeros"), *flags]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == ("warning: 3 of the 40 training tokens replayed repeat an expert in a top-2 (3 all zeros): "
                      "broken captures, which the heat counts as routes (`r3trace stats` counts such rows over the "
                      "run; `r3trace ingest --drop-repeated` leaves them out)")
