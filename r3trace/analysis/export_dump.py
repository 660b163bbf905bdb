"""A run written as SGLang expert-distribution dumps: the files SGLang's /dump_expert_distribution_record writes
(python/sglang/srt/eplb/expert_distribution.py, sgl-project/sglang 02295fe), for its tools, its
`--init-expert-location` (a stat dump's logical_count goes to its EPLB) and `r3trace ingest --format expert-dist`.

- stat: one file `expert_distribution_recorder_<time>.pt`, {rank: 0, logical_count [F, num_hidden_layers, E] int32
  (one row a forward, in forward order; dense layers 0), average_utilization_rate_over_window: None}. A heat-only run
  (no forwards) gives one row, its counts summed.
- per_pass: per dp rank `expert_distribution_recorder_<time>_<rank>.pt`, {records: one a forward the rank ran
  (forward_pass_id, rank, gatherer_key "primary", global_physical_count [num_hidden_layers, P] int32),
  last_physical_to_logical_map [num_hidden_layers, P]}. SGLang's dump holds one map, so a run that switched maps
  gives one dump per map in force (its forwards, its map): read back, each is its own placements row and every
  slot reads through the map it ran under. Slots come from physical_ids; a run without placements ran slot e =
  expert e (P = E).
per_token is not written: SGLang's records hold input_ids, which a trace does not keep.
<time> is the newest row's ts of what the file holds (time.time() at SGLang's dump), so ingest reads it back. Only
computed rows count, as SGLang counts what each forward routed: rows a request took from the prefix cache were
counted in the forward that computed them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import numpy as np

from r3trace.analysis.store import TraceStore
from r3trace.trace.placements import forward_rows
from r3trace.trace.reader import RunFiles
from r3trace.trace.schema import Manifest, TraceSchemaError

Mode = Literal["stat", "per_pass"]
MODES: tuple[Mode, ...] = ("stat", "per_pass")


def export_expert_distribution(store: TraceStore, run_id: str, out_dir: str | Path, mode: Mode = "stat") -> list[Path]:
    """Writes run_id as `mode` dumps into out_dir (made when missing); the files written. TraceSchemaError naming
    what the run lacks: rows (a routes run with none), physical_ids or a map for per_pass."""
    import torch  # only the files need torch

    run = store.run(run_id)
    m = run.manifest
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if mode == "stat":
        counts, ts = _stat(store, m)
        path = out / f"expert_distribution_recorder_{_seconds(ts)}.pt"
        _save({"rank": 0, "logical_count": torch.from_numpy(counts), "average_utilization_rate_over_window": None},
              path)
        return [path]
    written = []
    for phy2log, passes in _per_pass(store, run):
        full = np.tile(np.arange(phy2log.shape[1]) % m.num_experts, (m.num_hidden_layers, 1))  # dense: trivial
        full[list(m.moe_layer_ids)] = phy2log
        for rank, (fwd, gpc, ts) in sorted(passes.items()):
            records = [{"forward_pass_id": int(f), "rank": rank, "gatherer_key": "primary",
                        "global_physical_count": torch.from_numpy(g)} for f, g in zip(fwd, gpc, strict=True)]
            path = out / f"expert_distribution_recorder_{_seconds(ts)}_{rank}.pt"
            _save({"records": records, "last_physical_to_logical_map": torch.from_numpy(full)}, path)
            written.append(path)
    return written


def _save(body: dict[str, Any], path: Path) -> None:
    """torch.save to a side name, then a rename: a reader globbing *.pt never sees a torn file."""
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(body, tmp)
    os.replace(tmp, path)


def _seconds(ts_ns: int) -> str:
    return f"{ts_ns // 10**9}.{ts_ns % 10**9:09d}"


def _stat(store: TraceStore, m: Manifest) -> tuple[np.ndarray, int]:
    """logical_count [F, num_hidden_layers, E] int32 by forward, and the newest row's ts (ns)."""
    if m.kind == "heat":
        c = store.con.execute("SELECT layer_id, expert_id, sum(count), max(epoch_ns(window_start)) FROM rollups "
                              "WHERE run_id = ? GROUP BY ALL", [m.run_id]).fetchnumpy()
        counts = np.zeros((1, m.num_hidden_layers, m.num_experts), dtype=np.int32)
        np.add.at(counts[0], (c["layer_id"].astype(np.int64), c["expert_id"].astype(np.int64)),
                  c["sum(count)"].astype(np.int32))
        return counts, int(c["max(epoch_ns(window_start))"].max()) if len(c["layer_id"]) else 0
    c = _counts(store, m.run_id, "topk_ids", "forward_id, layer_id")
    fwd, f = np.unique(c["forward_id"], return_inverse=True)
    counts = np.zeros((len(fwd), m.num_hidden_layers, m.num_experts), dtype=np.int32)
    np.add.at(counts, (f, c["layer_id"].astype(np.int64), c["id"].astype(np.int64)), c["n"])
    return counts, int(c["ts"].max())


Passes = dict[int, tuple[np.ndarray, np.ndarray, int]]  # dp_rank -> (forward ids [F], counts [F, layers, P], ts)


def _per_pass(store: TraceStore, run: RunFiles) -> list[tuple[np.ndarray, Passes]]:
    """[(the map in force [L, P], {dp_rank: (forward ids [F], global_physical_count [F, num_hidden_layers, P],
    newest ts)})], one entry a map, oldest first."""
    m = run.manifest
    if m.kind == "heat":
        raise TraceSchemaError(f"run {m.run_id} is heat-only: per_pass needs each forward's slots")
    history = forward_rows(run)
    if not history and m.with_physical_ids:
        raise TraceSchemaError(f"run {m.run_id} has physical_ids but no placements table: its slot count is unknown")
    if history and not m.with_physical_ids:
        raise TraceSchemaError(f"run {m.run_id} ran an expert placement without physical_ids: which slot served each "
                               "expert is unknown (serve with --capture-physical-ids)")
    slots = "physical_ids" if m.with_physical_ids else "topk_ids"  # without a placement slot e holds expert e
    c = _counts(store, m.run_id, slots, "dp_rank, forward_id, layer_id")
    maps = _maps(history, m, int(c["forward_id"].min()))  # [(from forward, [L, P])]
    starts = np.array([f for f, _ in maps])
    seg = np.searchsorted(starts, c["forward_id"], side="right") - 1  # the map each row's forward ran
    out = []
    for i, (_, phy2log) in enumerate(maps):
        here = seg == i
        passes: Passes = {}
        for rank in np.unique(c["dp_rank"][here]).tolist():
            sel = here & (c["dp_rank"] == rank)
            fwd, f = np.unique(c["forward_id"][sel], return_inverse=True)
            gpc = np.zeros((len(fwd), m.num_hidden_layers, phy2log.shape[1]), dtype=np.int32)
            np.add.at(gpc, (f, c["layer_id"][sel].astype(np.int64), c["id"][sel].astype(np.int64)), c["n"][sel])
            passes[int(rank)] = (fwd, gpc, int(c["ts"][sel].max()))
        if passes:
            out.append((phy2log, passes))
    return out


def _counts(store: TraceStore, run_id: str, ids: str, by: str) -> dict[str, np.ndarray]:
    """Computed rows' ids (the column `ids`: topk_ids or physical_ids) counted per (`by`..., id): columns of `by`,
    id, n and ts (the newest row's, ns). TraceSchemaError when the run has no computed row."""
    c = store.con.execute(f"SELECT {by}, id, count(*)::INTEGER AS n, max(epoch_ns(ts)) AS ts FROM (SELECT {by}, ts, "
                          f"unnest({ids}) AS id FROM routes WHERE run_id = ? AND source = 'computed') GROUP BY ALL",
                          [run_id]).fetchnumpy()
    if not len(c["n"]):
        raise TraceSchemaError(f"run {run_id} holds no route rows to write")
    return c


def _maps(history: list[tuple[int, dict[int, np.ndarray]]], m: Manifest, first_forward: int
          ) -> list[tuple[int, np.ndarray]]:
    """Each distinct map in force over the run, from the forward it starts at, from its rows by forward
    (placements.forward_rows). Without placements, slot e = expert e from the first forward."""
    if not history:
        return [(first_forward, np.tile(np.arange(m.num_experts), (m.num_moe_layers, 1)))]
    if history[0][0] > first_forward:
        raise TraceSchemaError(f"run {m.run_id} has rows from forward {first_forward}, its first map from forward "
                               f"{history[0][0]}")
    current: dict[int, np.ndarray] = {}
    out: list[tuple[int, np.ndarray]] = []
    for f, at in history:
        current.update(at)
        if len(current) < m.num_moe_layers:
            raise TraceSchemaError(f"run {m.run_id}: at forward {f} some MoE layer has no map yet")
        phy2log = np.array([current[lid] for lid in m.moe_layer_ids], dtype=np.int64)
        if not out or not np.array_equal(out[-1][1], phy2log):
            out.append((f, phy2log))
    return out
