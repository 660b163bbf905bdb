"""`r3trace ingest --format expert-dist`: SGLang's expert-distribution dumps of every recorder mode.

The dumps are built as SGLang's recorder builds them: python/sglang/srt/eplb/expert_distribution.py at
sgl-project/sglang commit 02295fe5ac5ccff3e8829800d50450351c56fb53 (_DetailSinglePassGatherer: topk_ids_of_layer
[num_layers, tokens, _TOP_K_NUM = 8] reset to -1, written [:tokens, :top_k] on MoE layers; collect():
input_ids, positions, extend_seq_lens, forward_mode, global_physical_count [num_layers, P] counting the ids != -1;
_DetailAccumulator.append: records of forward_pass_id, rank, gatherer_key and those; dump: {records,
last_physical_to_logical_map} to expert_distribution_recorder_<time.time()>_<rank>.pt; _StatAccumulator.dump:
{rank, logical_count [passes, layers, E]} to expert_distribution_recorder_<time.time()>.pt). ForwardMode values:
python/sglang/srt/model_executor/forward_batch_info.py at commit 003bbaf9ab79c09933e7a17ae6460ac48a756de9 (EXTEND 1,
DECODE 2, MIXED 3, IDLE 4, TARGET_VERIFY 5).
Run: .venv/bin/pytest tests/analysis/test_ingest_dump.py -q
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch

from r3trace.analysis.ingest import IngestError, ModelShape
from r3trace.analysis.ingest_dump import ingest_expert_distribution
from r3trace.cli import main
from r3trace.trace.placements import placement_at
from r3trace.trace.reader import open_dataset

SHAPE = ModelShape(num_hidden_layers=4, moe_layer_ids=(1, 2, 3), num_experts=16, top_k=2)
P, NS = 20, 10**9
EXTEND, DECODE, MIXED, IDLE = 1, 2, 3, 4


def placement(seed: int) -> np.ndarray:
    """[num_hidden_layers, P]: every layer (dense ones too, as SGLang keeps them) a shuffle of slot % E."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(np.arange(P) % 16) for _ in range(4)])


def record(rng: np.random.Generator, phy2log: np.ndarray, fp: int, rank: int, mode: int,
           lens: list[int] | None, n: int) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """One per_token record as SGLang collects it, and the tokens' logical and physical ids [n, 3, 2]."""
    logical = np.stack([np.stack([rng.choice(16, 2, replace=False) for _ in range(3)]) for _ in range(n)]) \
        if n else np.zeros((0, 3, 2), dtype=np.int64)
    phys = np.zeros_like(logical)
    for (t, li, k), e in np.ndenumerate(logical):  # a replica of each logical expert, as SGLang's dispatch picks one
        phys[t, li, k] = rng.choice(np.flatnonzero(phy2log[SHAPE.moe_layer_ids[li]] == e))
    topk = torch.full((4, n, 8), -1, dtype=torch.int32)
    topk[list(SHAPE.moe_layer_ids), :, :2] = torch.from_numpy(phys.transpose(1, 0, 2)).int()
    flat = topk.reshape(4, -1)
    gpc = torch.zeros((4, P), dtype=torch.int32).scatter_add_(1, flat.masked_fill(flat == -1, 0).long(),
                                                             (flat != -1).int())
    positions = [int(p) for p in rng.integers(0, 500, n)]
    rec = dict(forward_pass_id=fp, rank=rank, gatherer_key="primary", input_ids=[int(i) for i in rng.integers(0, 9, n)],
               positions=positions, extend_seq_lens=lens, forward_mode=mode, topk_ids_of_layer=topk, misc_objects=[],
               global_physical_count=gpc)
    return rec, logical, phys


def save(folder: Path, when: float, rank: int, records: list[dict[str, Any]], phy2log: np.ndarray) -> Path:
    path = folder / f"expert_distribution_recorder_{when}_{rank}.pt"
    torch.save(dict(records=records, last_physical_to_logical_map=torch.from_numpy(phy2log)), path)
    return path


@pytest.fixture()
def dumps(tmp_path: Path) -> dict[str, Any]:
    """Two ranks under DP attention (different tokens), two dumps with a rebalance between them."""
    rng = np.random.default_rng(7)
    src = tmp_path / "dumps"
    src.mkdir()
    plan = [(EXTEND, [3, 2], 5), (DECODE, None, 4), (MIXED, [3, 1, 1], 5)]
    want: list[tuple[int, int, int, np.ndarray, np.ndarray, float]] = []  # rank, fp, mode, logical, phys, when
    maps = {0: placement(1), 1: placement(2)}
    for dump, when in ((0, 1_767_225_600.25), (1, 1_767_225_603.5)):
        for rank in (0, 1):
            recs = []
            for i, (mode, lens, n) in enumerate(plan):
                fp = 10 * dump + i
                if rank == 1 and i == 1:
                    mode, lens, n = IDLE, None, 0  # an idle DP rank: a record with no tokens
                rec, logical, phys = record(rng, maps[dump], fp, rank, mode, lens, n)
                recs.append(rec)
                want.append((rank, fp, mode, logical, phys, when))
            save(src, when + rank * 0.001, rank, recs, maps[dump])
    return {"src": src, "want": want, "maps": maps, "plan": plan}


def routes(store: Path, run: str) -> Any:
    return ds.dataset(store / "routes" / f"run_id={run}").to_table().to_pandas()


def test_per_token_dump_is_a_routes_run_with_its_maps(dumps: dict[str, Any], tmp_path: Path) -> None:
    """Every token of both ranks and both dumps comes back: logical topk_ids (the recorded slots read through the
    dump's map), the slots as physical_ids, forward_pass_id, rank, the dump's time, the phase of its mode (a MIXED
    pass's one-token sequences decode), a request per sequence; each dump's map is a placements row from its first
    pass, and every row's slots resolve under the map in force at its forward."""
    m = ingest_expert_distribution(dumps["src"], tmp_path / "s", SHAPE, run_id="sg")
    t = routes(tmp_path / "s", "sg").sort_values(["forward_id", "dp_rank", "request_id", "token_pos", "layer_id"])
    n_tokens = sum(len(w[3]) for w in dumps["want"])
    assert m.kind == "routes" and m.with_physical_ids and m.rows == len(t) == n_tokens * 3
    for rank, fp, mode, logical, phys, when in dumps["want"]:
        got = t[(t.forward_id == fp) & (t.dp_rank == rank)]
        if not len(logical):
            assert got.empty
            continue
        got = got.sort_index()  # the writer keeps a pass's tokens in order, token-major
        assert np.array_equal(np.stack(got.topk_ids.to_numpy()).reshape(-1, 3, 2), logical)
        assert np.array_equal(np.stack(got.physical_ids.to_numpy()).reshape(-1, 3, 2), phys)
        assert set(got.ts.astype("int64")) == {int(Decimal(str(when + rank * 0.001)) * NS)}  # the name's time
        seqs = got.request_id.to_numpy()[::3]
        if mode == EXTEND:
            assert list(seqs) == [f"sglang-r{rank}-f{fp}-s{s}" for s in (0, 0, 0, 1, 1)]
            assert set(got.phase) == {"prefill"}
        elif mode == DECODE:
            assert list(seqs) == [f"sglang-r{rank}-f{fp}-s{s}" for s in range(4)] and set(got.phase) == {"decode"}
        else:
            assert list(got.phase.to_numpy()[::3]) == ["prefill"] * 3 + ["decode"] * 2
    run = open_dataset(tmp_path / "s")[0]
    for first, dump in ((0, 0), (10, 1)):
        assert np.array_equal(placement_at(run, first), dumps["maps"][dump][1:])
    assert np.array_equal(placement_at(run, 9), dumps["maps"][0][1:])
    maps = {f: placement_at(run, f) for f in set(t.forward_id)}
    under = np.stack([maps[f][li - 1][np.asarray(p)] for f, li, p in zip(t.forward_id, t.layer_id, t.physical_ids,
                                                                       strict=True)])
    assert np.array_equal(under, np.stack(t.topk_ids.to_numpy()))  # 0 mismatches under each forward's own map


def test_per_pass_and_stat_dumps_are_heat_windows(tmp_path: Path) -> None:
    """per_pass: each dump's global_physical_count summed over passes and ranks, read through its map, in the rollup
    window of its time; a folder of stat dumps: one window each (passes summed; their order is not kept)."""
    rng = np.random.default_rng(3)
    src = tmp_path / "per_pass"
    src.mkdir()
    want = {}
    for when, seed in ((1_767_225_600.5, 1), (1_767_225_605.5, 2)):
        phy2log = placement(seed)
        recs = {r: [record(rng, phy2log, fp, r, DECODE, None, 6)[0] for fp in range(3)] for r in (0, 1)}
        for r, rs in recs.items():
            for rec in rs:  # per_pass records keep global_physical_count only
                for k in ("input_ids", "positions", "extend_seq_lens", "forward_mode", "topk_ids_of_layer"):
                    rec.pop(k)
            save(src, when, r, rs, phy2log)
        slots = sum(rec["global_physical_count"].numpy() for rs in recs.values() for rec in rs)[1:]  # [3, P]
        want[int(when) * NS] = np.stack([np.bincount(phy2log[l + 1], weights=slots[l], minlength=16)
                                         for l in range(3)])
    m = ingest_expert_distribution(src, tmp_path / "s", SHAPE, run_id="pp")
    assert m.kind == "heat"
    r = ds.dataset(tmp_path / "s" / "rollups" / "run_id=pp").to_table().to_pandas()
    for start, counts in want.items():
        w = r[r.window_start.astype("int64") == start]
        got = np.zeros((3, 16))
        got[w.layer_id - 1, w.expert_id] = w["count"]
        assert np.array_equal(got, counts)
    assert set(r.window_start.astype("int64")) == set(want)

    stat = tmp_path / "stat"
    stat.mkdir()
    counts = rng.integers(0, 9, (2, 5, 4, 16))
    for when, c in zip((1_767_225_600.5, 1_767_225_700.5), counts, strict=True):
        torch.save({"rank": 0, "logical_count": torch.from_numpy(c)}, stat / f"expert_distribution_recorder_{when}.pt")
    ingest_expert_distribution(stat, tmp_path / "s", SHAPE, run_id="st")

    idle = tmp_path / "idle"  # two DP ranks idle in the passes they share, rank 0 busy in a third: not a TP copy
    idle.mkdir()
    for r in range(2):
        recs = [record(rng, placement(1), fp, r, DECODE, None, 3 if fp == 2 else 0)[0] for fp in range(3 - r)]
        save(idle, 1_767_225_600.5, r, recs, placement(1))
    ingest_expert_distribution(idle, tmp_path / "s", SHAPE, run_id="idle_tokens")  # per_token, 0-token passes
    for p in idle.glob("*.pt"):
        body = torch.load(p, weights_only=True)
        body["records"] = [{k: v for k, v in rec.items() if k in ("forward_pass_id", "rank", "gatherer_key",
                                                                   "global_physical_count")} for rec in body["records"]]
        torch.save(body, p)
    ingest_expert_distribution(idle, tmp_path / "s", SHAPE, run_id="idle_passes")  # per_pass
    body = torch.load(idle / "expert_distribution_recorder_1767225600.5_0.pt", weights_only=True)
    body["records"] = [{**rec, "rank": 1} for rec in body["records"]]  # rank 1 holding rank 0's passes: a TP copy
    torch.save(body, idle / "expert_distribution_recorder_1767225600.5_1.pt")
    with pytest.raises(IngestError, match="ranks 0, 1 recorded the same tokens in all 1 passes they share"):
        ingest_expert_distribution(idle, tmp_path / "s", SHAPE, run_id="tp_passes")
    r = ds.dataset(tmp_path / "s" / "rollups" / "run_id=st").to_table().to_pandas()
    for start, c in zip((1_767_225_600 * NS, 1_767_225_700 * NS), counts, strict=True):
        w = r[r.window_start.astype("int64") == start]
        assert int(w["count"].sum()) == int(c[:, 1:].sum())


def _tp_copy(src: Path) -> None:
    """Rank 1's files replaced by rank 0's records under rank 1: TP without DP attention."""
    for p in sorted(src.glob("*_1.pt")):
        p.unlink()
    for p in sorted(src.glob("*_0.pt")):
        body = torch.load(p, weights_only=True)
        body["records"] = [{**r, "rank": 1} for r in body["records"]]
        torch.save(body, p.with_name(p.name.replace("_0.pt", "_1.pt")))


@pytest.mark.parametrize("case, message", [
    ("tp", "ranks 0, 1 recorded the same tokens in all 6 passes they share (SGLang without DP attention: every TP rank "
           "records the whole batch); ingest one rank's file"),
    ("torn", "records[0]: field global_physical_count disagrees with topk_ids_of_layer (a torn record)"),
    ("slot", "records[0]: field topk_ids_of_layer holds slot 20: slots are 0..19 (the map's width)"),
    ("dense", "records[0]: field topk_ids_of_layer holds an expert on a dense layer (give --top-k and the layer "
              "layout of the model SGLang ran)"),
    ("column", "records[0]: field topk_ids_of_layer holds an expert on a column past top_k 2"),
    ("again", "records[1]: rank 0 forward_pass_id 0 is already in"),
    ("mode", "records[0]: field forward_mode is 6; r3trace reads [1, 2, 3, 5, 8]"),
    ("lens", "records[0]: field extend_seq_lens sums to 4, the pass has 5 tokens"),
    ("missing", "records[0]: field positions missing"),
    ("map", "field last_physical_to_logical_map differs from another rank's dump starting at forward_pass_id 0"),
    ("mixed", "dumps of 2 recorder modes (per_token, stat); ingest one mode at a time"),
    ("noslot", "field last_physical_to_logical_map row 2 (a MoE layer): expert 0 of 0..15 has no slot"),
])
def test_bad_dumps_are_refused_in_one_line_and_leave_nothing(dumps: dict[str, Any], tmp_path: Path, case: str,
                                                            message: str) -> None:
    src = dumps["src"]
    if case == "tp":
        _tp_copy(src)
    elif case == "mixed":
        torch.save({"logical_count": torch.zeros(4, 16, dtype=torch.int64)}, src / "expert_distribution_recorder_1.pt")
    elif case == "map":
        path = sorted(src.glob("*_1.pt"))[0]
        body = torch.load(path, weights_only=True)
        body["last_physical_to_logical_map"] = (body["last_physical_to_logical_map"] + 1) % 16  # experts relabelled
        torch.save(body, path)
    elif case == "noslot":
        path = sorted(src.glob("*_0.pt"))[0]
        body = torch.load(path, weights_only=True)
        row = body["last_physical_to_logical_map"][2]
        row[row == 0] = 1
        torch.save(body, path)
    elif case == "missing":
        path = sorted(src.glob("*_0.pt"))[0]
        body = torch.load(path, weights_only=True)
        body["records"][0].pop("positions")
        torch.save(body, path)
    else:
        path = sorted(src.glob("*_0.pt"))[0]
        body = torch.load(path, weights_only=True)
        r = body["records"][0]
        if case == "torn":
            r["global_physical_count"][1, 0] += 1
        elif case == "slot":
            r["topk_ids_of_layer"][2, 0, 0] = P
        elif case == "dense":
            r["topk_ids_of_layer"][0, 0, 0] = 3
        elif case == "column":
            r["topk_ids_of_layer"][1, 0, 2] = 3
        elif case == "again":
            body["records"][1]["forward_pass_id"] = 0
        elif case == "mode":
            r["forward_mode"] = 6
        elif case == "lens":
            r["extend_seq_lens"] = [3, 1]
        torch.save(body, path)
    with pytest.raises(IngestError) as e:
        ingest_expert_distribution(src, tmp_path / "s", SHAPE, run_id="x")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "s").glob("run_id=*")) and not list((tmp_path / "s").glob(".staging-*"))


def test_cli_ingests_a_folder_and_eplb_takes_its_recorded_map(dumps: dict[str, Any], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`r3trace ingest DIR --format expert-dist` then `r3trace eplb --previous recorded`: the map SGLang ran last
    (the second dump's) is the previous placement, the same report as that map given as SGLang's file."""
    store = tmp_path / "s"
    shape = ["--num-hidden-layers", "4", "--first-k-dense", "1", "--num-experts", "16", "--top-k", "2",
             "--num-groups", "4"]
    assert main(["ingest", str(dumps["src"]), "--store", str(store), "--format", "expert-dist", "--run-id", "sg",
                 *shape]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run sg: routes, {sum(len(w[3]) for w in dumps['want']) * 3} rows; time from ")
    sglang = tmp_path / "map.json"
    sglang.write_text(f'{{"physical_to_logical_map": {dumps["maps"][1].tolist()}}}')
    cluster = ["--gpus", "4", "--nodes", "2", "--slots", str(P)]
    assert main(["eplb", str(store), *cluster, "--previous", str(sglang)]) == 0
    want = capsys.readouterr().out.replace(str(sglang), "run sg's recorded placement at forward 12")
    assert main(["eplb", str(store), *cluster, "--previous", "recorded"]) == 0
    assert capsys.readouterr().out == want
