"""CLI commands end to end and the trace-replay simulator, every printed or returned number recomputed here
with numpy from the trace's own routes (read_token_routes), not through the functions under test.

Run: .venv/bin/pytest tests/analysis/test_cli_replay.py -q
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from r3trace.analysis.synth import SynthConfig, write_synth
from r3trace.cli import COMMANDS, build_parser, main
from r3trace.eplb import Cluster, Placement, PlannerConfig, global_policy, plan
from r3trace.eplb.replay import ReplayConfig, replay
from r3trace.eplb.score import heat_of
from r3trace.trace import TraceWriter, open_dataset, read_token_routes
from r3trace.trace.reader import TokenRoutes
from r3trace.trace.schema import PHASES

SMALL = SynthConfig(num_hidden_layers=6, first_k_dense=1, num_experts=32, top_k=4, num_groups=8, topk_group=2,
                    bank_size=256, prompt_len=(8, 16), completion_len=(4, 8), max_running=8)


def _table_row(text: str, first: str | None = None, last: str | None = None) -> list[str]:
    """The cells of the one data row of a printed polars table whose first (or last) cell is given."""
    rows = [[c.strip() for c in line.strip().strip("│").split("┆")] for line in text.splitlines()
            if line.startswith("│") and "┆" in line]
    data = [row for row in rows if row[0] == first or row[-1] == last]
    assert len(data) == 1, text
    return data[0]


def _heat(ids: np.ndarray, e: int) -> np.ndarray:
    """[T, L, K] -> [L, E] selections, one layer at a time."""
    return np.stack([np.bincount(ids[:, li].ravel(), minlength=e) for li in range(ids.shape[1])]).astype(float)


def _imbalance_means(heat: np.ndarray) -> dict[str, float]:
    """Mean over layers of max/mean, cv, normalised entropy and Gini of each layer's heat over all E experts."""
    e = heat.shape[1]
    out: dict[str, list[float]] = {"max_over_mean": [], "cv": [], "norm_entropy": [], "gini": []}
    for c in heat:
        p = c[c > 0] / c.sum()
        x = np.sort(c)
        out["max_over_mean"].append(c.max() / c.mean())
        out["cv"].append(c.std() / c.mean())
        out["norm_entropy"].append(-(p * np.log(p)).sum() / np.log(e))
        out["gini"].append(((2 * np.arange(1, e + 1) - e - 1) * x).sum() / (e * x.sum()))
    return {k: float(np.mean(v)) for k, v in out.items()}


def _locality(r: TokenRoutes, k: int) -> tuple[float, float]:
    """(mean over layers of |S_t n S_t-1| / K over consecutive positions of a request, mean over layers of
    sum_e pi_e^2 / K)."""
    order = np.lexsort((r.token_pos, r.request_id))
    req, pos, ids = r.request_id[order], r.token_pos[order], r.topk_ids[order]
    pair = (req[1:] == req[:-1]) & (pos[1:] == pos[:-1] + 1)  # [T - 1]
    overlaps, baselines = [], []
    for li in range(ids.shape[1]):
        cur, prev = ids[1:, li][pair], ids[:-1, li][pair]
        overlaps.append(np.mean([len(set(a) & set(b)) for a, b in zip(cur.tolist(), prev.tolist(), strict=True)]) / k)
        pi = np.bincount(ids[:, li].ravel()) / len(ids)
        baselines.append((pi**2).sum() / k)
    return float(np.mean(overlaps)), float(np.mean(baselines))


def test_cli_synth_stats_sql_eplb_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert {n for n, _ in COMMANDS} >= {"sql", "stats", "eplb", "diff", "synth", "ingest"}
    build_parser()
    out = tmp_path / "t"
    assert main(["synth", str(out), "--tokens", "500", "--run-id", "s", "--seed", "1"]) == 0
    run = open_dataset(out)[0]
    r = read_token_routes(run)
    t, n_layers, k = r.topk_ids.shape
    e, rows = run.manifest.num_experts, t * n_layers
    assert run.manifest.rows == rows and t >= 500
    capsys.readouterr()

    assert main(["sql", "select count(*) as n from routes", "--store", str(out), "--format", "csv"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == ["n", str(rows)]
    assert main(["sql", f"copy (select 1) to '{out}/x.csv'", "--store", str(out)]) == 2  # read-only: refused
    assert "statement type COPY refused" in capsys.readouterr().err and not (out / "x.csv").exists()

    assert main(["stats", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == (f"run s: routes, model synthetic-deepseek-v3, L={n_layers} E={e} K={k}, {rows} rows in 1 "
                        f"files, {t} tokens")
    cells = _table_row(text, last="mean over layers")
    got = dict(zip(["max_over_mean", "cv", "norm_entropy", "gini"], map(float, cells[:4]), strict=True))
    assert got == pytest.approx(_imbalance_means(_heat(r.topk_ids, e)), rel=1e-5)  # printed to 6 decimals
    overlap, baseline = _locality(r, k)
    assert lines[-1] == f"temporal locality: mean overlap {overlap:.3f} (independent tokens: {baseline:.3f})"

    assert main(["eplb", str(out), "--gpus", "32", "--nodes", "4", "--slots", "288",
                 "--sglang", str(tmp_path / "p.json")]) == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    assert list(doc) == ["physical_to_logical_map"]  # SGLang's loader takes no other key
    full, moe = np.asarray(doc["physical_to_logical_map"]), list(run.manifest.moe_layer_ids)
    assert full.shape == (run.manifest.num_hidden_layers, 288)  # SGLang indexes rows by real layer id
    dense = [li for li in range(run.manifest.num_hidden_layers) if li not in moe]
    assert dense and (full[dense] == np.arange(288) % e).all()  # the trivial map on dense layers
    p2l = full[moe]
    cnt = np.stack([np.bincount(row, minlength=e) for row in p2l])
    assert p2l.shape == (n_layers, 288) and cnt.shape == (n_layers, e)
    assert all(np.array_equal(np.bincount(p2l[li], minlength=e), cnt[li]) for li in range(n_layers))
    assert (cnt >= 1).all()
    rows_ = np.arange(n_layers)[:, None]
    gpu = (_heat(r.topk_ids, e)[rows_, p2l] / cnt[rows_, p2l]).reshape(n_layers, 32, 9).sum(-1)  # [L, G]
    bal = float((gpu.mean(1) / gpu.max(1)).mean())
    printed = capsys.readouterr().out.strip().splitlines()
    # the whole run is the training window (nothing held out): in-sample = the plan on the run's own heat
    assert [x.split()[-2:] for x in printed if x.startswith("balancedness (even split)")] == [[f"{bal:.4f}", "-"]]
    assert next(x for x in printed if "forecast: P=288 on 32 GPUs / 4 nodes" in x).endswith(f"max replicas {cnt.max()}")
    assert printed[-1] == (f"SGLang: --init-expert-location {tmp_path / 'p.json'} --expert-parallel-size 32 "
                           f"--ep-num-redundant-experts {288 - e} --ep-dispatch-algorithm static")
    # SGLang dispatches static once --init-expert-location is loaded and --ep-dispatch-algorithm is unset
    # (python/sglang/srt/server_args.py, _handle_eplb_and_dispatch, sgl-project/sglang@469c63e), so --sglang
    # without --dispatch plans for that dispatcher: the map is --dispatch static's, not node-limited's
    assert printed[-2].startswith("dispatch: planned for SGLang's static dispatch")
    cluster = ["eplb", str(out), "--gpus", "32", "--nodes", "4", "--slots", "288"]
    assert main([*cluster, "--dispatch", "static", "--out", str(tmp_path / "q.json")]) == 0
    assert np.array_equal(np.asarray(json.loads((tmp_path / "q.json").read_text())["phy2log"]), p2l)
    assert main([*cluster, "--dispatch", "node-limited", "--sglang", str(tmp_path / "n.json")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert not np.array_equal(np.asarray(json.loads((tmp_path / "n.json").read_text())["physical_to_logical_map"])[moe],
                              p2l)
    assert printed[-2].startswith("warning: planned for node-limited dispatch, which SGLang does not run")
    assert printed[-1].endswith(f"--ep-num-redundant-experts {288 - e}")

    # diff against itself, and against a copy with one expert replaced in every 5th (token, layer) row
    assert main(["diff", str(out / "run_id=s"), str(out / "run_id=s")]) == 0
    assert _table_row(capsys.readouterr().out, str(rows)) == [str(rows), "0", "0", "1.0", str(t), "0.0", "1.0"]
    other = r.topk_ids.copy()
    changed = (np.arange(rows) % 5 == 0).reshape(t, n_layers)  # [T, L]
    for ti, li in zip(*np.nonzero(changed), strict=True):
        other[ti, li, 0] = np.setdiff1d(np.arange(e), other[ti, li])[0]
    m = run.manifest
    w = TraceWriter(tmp_path / "b", model_name=m.model_name, num_hidden_layers=m.num_hidden_layers,
                    moe_layer_ids=m.moe_layer_ids, num_experts=e, top_k=k, run_id="b")
    phases = np.asarray(PHASES)[r.phase]
    w.append_tokens(r.request_id, r.token_pos, phases, "computed", r.forward_id, 0, r.dp_rank, other)
    w.close()
    assert main(["diff", str(out / "run_id=s"), str(tmp_path / "b")]) == 0
    cells = _table_row(capsys.readouterr().out, str(rows))
    n_changed, tokens_changed = int(changed.sum()), int(changed.any(1).sum())
    assert cells[:3] == [str(rows), "0", "0"] and cells[4] == str(t)
    expected = [1 - n_changed / rows, tokens_changed / t, 1 - n_changed / (rows * k)]
    assert [float(cells[3]), float(cells[5]), float(cells[6])] == pytest.approx(expected, rel=1e-5)


def test_synth_is_deterministic_by_seed(tmp_path: Path) -> None:
    a = read_token_routes(open_dataset(write_synth(tmp_path / "a", SMALL, 300, progress=False).run_dir)[0])
    b = read_token_routes(open_dataset(write_synth(tmp_path / "b", SMALL, 300, progress=False).run_dir)[0])
    assert np.array_equal(a.topk_ids, b.topk_ids) and np.array_equal(a.forward_id, b.forward_id)
    per_group = a.topk_ids // (32 // 8)  # group-limited routing: <= topk_group groups per token-layer
    assert max(len(set(row)) for row in per_group.reshape(-1, 4).tolist()) <= 2


def _forwards(r: TokenRoutes) -> list[np.ndarray]:
    """The token indices of each forward, in trace order."""
    return np.split(np.arange(len(r.forward_id)), np.flatnonzero(np.diff(r.forward_id)) + 1)


def _min_nodes(pl: Placement, ids: np.ndarray, cl: Cluster) -> np.ndarray:
    """[T, L] size of the smallest node set holding all K experts of each row, by trying every subset."""
    node_of = np.arange(cl.num_slots) // cl.slots_per_node
    out = np.zeros(ids.shape[:2], dtype=np.int64)
    for li in range(ids.shape[1]):
        homes = [frozenset(node_of[pl.phy2log[li] == x].tolist()) for x in range(pl.num_experts)]
        for ti, row in enumerate(ids[:, li].tolist()):
            out[ti, li] = next(n for n in range(1, cl.num_nodes + 1) for s in itertools.combinations(
                range(cl.num_nodes), n) if all(homes[x] & set(s) for x in row))
    return out


def test_replay_of_a_fixed_placement(tmp_path: Path) -> None:
    r = read_token_routes(open_dataset(write_synth(tmp_path, SMALL, 2000, progress=False).run_dir)[0])
    fwd = _forwards(r)
    # one node: every replica is on the one chosen node, so each (token, layer) unit is split evenly over
    # its expert's replicas and the GPU load of a forward is its heat / logcnt summed per GPU
    one = Cluster(4, 1, 40, num_groups=8, node_limit=1)
    pl = global_policy(heat_of(r.topk_ids, 32), one)
    got = replay(r, one, 32, placement=pl)
    assert got["tokens"].to_list() == [len(f) for f in fwd]
    assert got["forward_id"].to_list() == [int(r.forward_id[f[0]]) for f in fwd]
    lrow = np.arange(5)[:, None]
    bal, mom = [], []
    for f in fwd:
        gpu = (_heat(r.topk_ids[f], 32)[lrow, pl.phy2log] / pl.logcnt[lrow, pl.phy2log]).reshape(5, 4, 10).sum(-1)
        bal.append(float((gpu.mean(1) / gpu.max(1)).mean()))
        mom.append(float((gpu.max(1) / gpu.mean(1)).mean()))
    np.testing.assert_allclose(got["balancedness"].to_numpy(), bal, rtol=1e-12)
    np.testing.assert_allclose(got["max_over_mean"].to_numpy(), mom, rtol=1e-12)
    assert min(bal) < 0.9  # forwards of a few tokens are far from balanced: the values are not all 1
    assert set(got["mean_nodes"].to_list()) == {1.0} and set(got["mean_remote"].to_list()) == {0.0}
    assert set(got["migration_bytes"].to_list()) == {0} and set(got["replicas"].to_list()) == {40 - 32}

    # four nodes: nodes per token are the minimum cover, found here by trying every node subset
    four = Cluster(8, 4, 40, num_groups=8, node_limit=2)
    pl4 = global_policy(heat_of(r.topk_ids, 32), four)
    got4 = replay(r, four, 32, placement=pl4)
    nodes = _min_nodes(pl4, r.topk_ids, four)
    np.testing.assert_allclose(got4["mean_nodes"].to_numpy(), [nodes[f].mean() for f in fwd], rtol=1e-12)
    assert got4["max_nodes"].to_list() == [int(nodes[f].max()) for f in fwd]
    np.testing.assert_allclose(got4["over_limit"].to_numpy(), [(nodes[f] > 2).mean() for f in fwd], rtol=1e-12)


def test_replay_with_replanning_moves_what_the_plans_changed(tmp_path: Path) -> None:
    """Every re-plan (after each window of 20 forwards) is rolled out 2 layers per forward, so the 3 forwards
    after it migrate the slots its layers 0-1, 2-3 and 4 changed against the placement it replaced."""
    r = read_token_routes(open_dataset(write_synth(tmp_path, SMALL, 2000, progress=False).run_dir)[0])
    fwd = _forwards(r)
    cl = Cluster(8, 4, 40, num_groups=8, node_limit=2)
    cfg = ReplayConfig(window_steps=20, chunk_layers=2, expert_bytes=3)
    calls: list[tuple[Placement | None, Placement]] = []

    def policy(h: np.ndarray, prev: Placement | None, tok: np.ndarray) -> Placement:
        calls.append((prev, plan(h, cl, prev, cfg=PlannerConfig(keep_groups=True))))
        return calls[-1][1]

    got = replay(r, cl, 32, policy=policy, cfg=cfg)
    assert got.height == len(fwd) and got["window"].to_list() == [i // 20 for i in range(len(fwd))]
    assert calls[0][0] is None and len(calls) == 1 + len(fwd) // 20  # a cold start, then one per whole window
    expected = np.zeros(len(fwd), dtype=np.int64)
    for j, (prev, new) in enumerate(calls[1:], start=1):
        assert prev is not None
        for c, layers in enumerate((slice(0, 2), slice(2, 4), slice(4, 5))):
            if j * 20 + c < len(fwd):
                expected[j * 20 + c] = (prev.phy2log[layers] != new.phy2log[layers]).sum() * 3
    assert got["migration_bytes"].to_list() == expected.tolist()
    assert expected.sum() > 0  # the plans did move replicas
    # keep_groups: whole groups on their home nodes, 2 groups per token -> at most 2 nodes
    assert int(got["max_nodes"].to_numpy().max()) <= 2
