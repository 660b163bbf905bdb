"""`r3trace export`: a run as SGLang expert-distribution dumps, in the shapes SGLang's recorder writes
(python/sglang/srt/eplb/expert_distribution.py at sgl-project/sglang commit
02295fe5ac5ccff3e8829800d50450351c56fb53: _StatAccumulator.dump {rank, logical_count [passes, layers, E],
average_utilization_rate_over_window} as expert_distribution_recorder_<time.time()>.pt; _DetailAccumulator.dump
{records, last_physical_to_logical_map} as expert_distribution_recorder_<time.time()>_<rank>.pt), read back by
`r3trace ingest --format expert-dist` (tests/analysis/test_ingest_dump.py builds SGLang's own shapes) to the
trace's own counts.
Run: .venv/bin/pytest tests/analysis/test_export_dump.py -q
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch

from r3trace.analysis.export_dump import export_expert_distribution
from r3trace.analysis.ingest import ModelShape
from r3trace.analysis.ingest_dump import ingest_expert_distribution
from r3trace.analysis.store import TraceStore
from r3trace.cli import main
from r3trace.trace.writer import TraceWriter

LAYERS, E, P, K, F = (1, 2, 3), 16, 20, 2, 24
SHAPE = ModelShape(num_hidden_layers=4, moe_layer_ids=LAYERS, num_experts=E, top_k=K)
T0 = 1_767_225_600 * 10**9


def maps(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(np.arange(P) % E) for _ in LAYERS])  # [L, P]


def write(root: Path, run: str = "a", placed: bool = True, physical: bool = True) -> np.ndarray:
    """F forwards of 3 tokens on dp rank 0 and 2 on rank 1, 0.1 s apart; maps A from 0, then a rebalance in two
    chunks (layer 1 from forward 10, layers 2 and 3 from 12: three maps in force); slots picked under the map each
    forward ran. Returns the logical ids [tokens, L, K]."""
    rng = np.random.default_rng(4)
    a, b = maps(1), maps(2)
    mid = np.concatenate([b[:1], a[1:]])
    ran = [(0, a), (10, mid), (12, b)]
    rows = []
    with TraceWriter(root, model_name="m", num_hidden_layers=4, moe_layer_ids=LAYERS, num_experts=E, top_k=K,
                     run_id=run, with_physical_ids=physical, flush_interval_s=None) as w:
        if placed:
            w.add_placement(0, LAYERS, a)
            w.add_placement(10, LAYERS[:1], b[:1])
            w.add_placement(12, LAYERS[1:], b[1:])
        for f in range(F):
            m = [x for s, x in ran if s <= f][-1] if placed else np.tile(np.arange(E), (3, 1))
            for rank, n in ((0, 3), (1, 2)):
                ids = np.argsort(rng.random((n, 3, E)), axis=-1)[..., :K]
                phys = np.zeros_like(ids)
                for (t, li, k), e in np.ndenumerate(ids):
                    phys[t, li, k] = rng.choice(np.flatnonzero(m[li] == e))
                w.append_tokens([f"r{rank}-{f}-{t}" for t in range(n)], np.arange(n), "decode", "computed", f,
                                T0 + f * 10**8, rank, ids, physical_ids=phys if physical else None)
                rows.append(ids)
    return np.concatenate(rows)


def heat(store: Path, run: str) -> np.ndarray:
    """[L, E] from the run's rollups."""
    r = ds.dataset(store / "rollups" / f"run_id={run}").to_table().to_pandas()
    out = np.zeros((3, E), dtype=np.int64)
    np.add.at(out, (r.layer_id.to_numpy() - 1, r.expert_id.to_numpy()), r["count"].to_numpy())
    return out


def truth(ids: np.ndarray) -> np.ndarray:
    return np.stack([np.bincount(ids[:, li].ravel(), minlength=E) for li in range(3)])


def test_stat_dump_is_each_forwards_logical_counts(tmp_path: Path) -> None:
    ids = write(tmp_path / "s")
    [path] = export_expert_distribution(TraceStore(tmp_path / "s"), "a", tmp_path / "out", "stat")
    newest = T0 + (F - 1) * 10**8  # the newest row's ts: SGLang's time.time() at the dump
    assert path.name == f"expert_distribution_recorder_{newest // 10**9}.{newest % 10**9:09d}.pt"
    body = torch.load(path, weights_only=True)
    assert set(body) == {"rank", "logical_count", "average_utilization_rate_over_window"} and body["rank"] == 0
    c = body["logical_count"]
    assert c.dtype == torch.int32 and tuple(c.shape) == (F, 4, E) and not c[:, 0].any()  # dense layer 0 empty
    assert np.array_equal(c[3, 1:].numpy(), truth(ids[5 * 3:5 * 4]))  # forward 3: its 5 tokens over both ranks
    ingest_expert_distribution(path, tmp_path / "back", SHAPE, run_id="b")
    assert np.array_equal(heat(tmp_path / "back", "b"), truth(ids))


def test_per_pass_dumps_one_a_map_read_back_to_the_traces_counts(tmp_path: Path) -> None:
    """Three maps in force (the rebalance's two chunks) x two ranks: six files, each rank's forwards under one map;
    ingested as a folder the heat equals the trace's counts, which reading every slot through the last map does not."""
    ids = write(tmp_path / "s")
    paths = export_expert_distribution(TraceStore(tmp_path / "s"), "a", tmp_path / "out", "per_pass")
    assert len(paths) == 6 and {p.name[-5:] for p in paths} == {"_0.pt", "_1.pt"}
    bodies = [torch.load(p, weights_only=True) for p in paths]
    assert [[r["forward_pass_id"] for r in b["records"]] for b in bodies[::2]] == [list(range(10)), [10, 11],
                                                                                    list(range(12, F))]
    for b, p in zip(bodies, paths, strict=True):
        rank = int(p.name[-4])
        assert all(r["rank"] == rank and r["gatherer_key"] == "primary" for r in b["records"])
        gpc = torch.stack([r["global_physical_count"] for r in b["records"]])
        assert gpc.dtype == torch.int32 and gpc.shape[1:] == (4, P)
        assert int(gpc.sum()) == len(b["records"]) * (3 - rank) * 3 * K  # 3 or 2 tokens, 3 layers, K slots
        assert b["last_physical_to_logical_map"].shape == (4, P)
    ingest_expert_distribution(tmp_path / "out", tmp_path / "back", SHAPE, run_id="b")
    assert np.array_equal(heat(tmp_path / "back", "b"), truth(ids))

    last = bodies[-1]["last_physical_to_logical_map"].numpy()[1:]  # what one SGLang dump of the whole run says
    slots = sum(r["global_physical_count"].numpy()[1:] for b in bodies for r in b["records"])
    wrong = np.stack([np.bincount(last[li], weights=slots[li], minlength=E) for li in range(3)])
    assert not np.array_equal(wrong, truth(ids))


def test_a_run_without_placements_ran_slot_e_as_expert_e(tmp_path: Path) -> None:
    ids = write(tmp_path / "s", placed=False, physical=False)
    paths = export_expert_distribution(TraceStore(tmp_path / "s"), "a", tmp_path / "out", "per_pass")
    assert len(paths) == 2
    assert np.array_equal(torch.load(paths[0], weights_only=True)["last_physical_to_logical_map"].numpy(),
                          np.tile(np.arange(E), (4, 1)))
    ingest_expert_distribution(tmp_path / "out", tmp_path / "back", SHAPE, run_id="b")
    assert np.array_equal(heat(tmp_path / "back", "b"), truth(ids))


@pytest.mark.parametrize("case, message", [
    ("no physical", "--mode per_pass: run a ran an expert placement without physical_ids: which slot served each "
                    "expert is unknown (serve with --capture-physical-ids)"),
    ("no map", "--mode per_pass: run a has physical_ids but no placements table: its slot count is unknown"),
])
def test_cli_writes_the_files_or_says_what_the_run_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         case: str, message: str) -> None:
    write(tmp_path / "s")
    assert main(["export", str(tmp_path / "s"), "--out", str(tmp_path / "out"), "--mode", "per_pass"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 6
    bad = tmp_path / "bad"
    write(bad, physical=case == "no map", placed=case == "no physical")
    assert main(["export", str(bad), "--out", str(tmp_path / "out2"), "--mode", "per_pass"]) == 2
    assert capsys.readouterr().err.strip() == f"r3trace export: {message}"


def test_a_heat_run_exports_one_pass_of_its_counts(tmp_path: Path) -> None:
    """A heat-only run (an ingested stat dump) has no forwards: stat writes its counts as one pass; per_pass refuses."""
    ids = write(tmp_path / "s")
    [path] = export_expert_distribution(TraceStore(tmp_path / "s"), "a", tmp_path / "out", "stat")
    ingest_expert_distribution(path, tmp_path / "heat", SHAPE, run_id="h")
    [again] = export_expert_distribution(TraceStore(tmp_path / "heat"), "h", tmp_path / "out2", "stat")
    c = torch.load(again, weights_only=True)["logical_count"]
    assert c.dtype == torch.int32 and tuple(c.shape) == (1, 4, E) and np.array_equal(c[0, 1:].numpy(), truth(ids))
    assert again.name == f"expert_distribution_recorder_{T0 // 10**9 + 2}.000000000.pt"  # its rollup window's start
    with pytest.raises(ValueError, match="run h is heat-only: per_pass needs each forward's slots"):
        export_expert_distribution(TraceStore(tmp_path / "heat"), "h", tmp_path / "out3", "per_pass")
