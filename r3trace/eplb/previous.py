"""The placement a cluster runs now, read for `r3trace eplb --previous FILE`: ours re-plans from it (its churn budget)
and the report scores it beside the plan, in-sample and held out, so a re-plan's gain over keeping it is printed.

Two files are read:
- the JSON `--out` writes (placement.to_json: phy2log, log2phy, logcnt and the cluster it was planned for);
- SGLang's expert-location file, what its --init-expert-location loads and `--sglang` writes:
  {"physical_to_logical_map": [num_hidden_layers][P]} as .json, or as .pt (a torch tensor, or nested lists). SGLang
  indexes the map by real layer id, dense layers included (python/sglang/srt/eplb/expert_location.py,
  ExpertLocationMetadata.init_by_mapping), so the trace's MoE layer ids pick its rows; the file holds no cluster, so
  the flags' is taken, its slots checked against the map's width.
`--previous recorded` reads neither: the trace's own placements table (r3trace/trace/placements.py), which an r3trace
engine writes when a trace starts and as a rebalance switches layers (an SGLang per_token dump's ingest: each dump's
map): each MoE layer's map in force at the training window's newest forward, what the cluster ran when the plan is
made.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from r3trace.eplb.placement import Cluster, Placement, PlacementError, from_doc, from_phy2log
from r3trace.eplb.window import Selection
from r3trace.phy2log import rows_fault
from r3trace.trace.placements import placement_at
from r3trace.trace.reader import RunFiles
from r3trace.trace.schema import TraceSchemaError

SGLANG_KEY = "physical_to_logical_map"
RECORDED = "recorded"  # --previous's word for the trace's own placements table


def read_previous(path: str | Path, cluster: Cluster, num_hidden_layers: int, moe_layer_ids: tuple[int, ...],
                  num_experts: int) -> Placement:
    """The placement in `path` for this cluster and model shape; PlacementError naming what disagrees (a file of
    neither kind, another cluster, other layer or expert counts, an expert with no slot)."""
    path = Path(path)
    doc = load_location(path)
    if isinstance(doc, dict) and SGLANG_KEY in doc:
        return _from_sglang(doc[SGLANG_KEY], path, cluster, num_hidden_layers, moe_layer_ids, num_experts)
    if not isinstance(doc, dict) or "cluster" not in doc:
        keys = sorted(doc)[:5] if isinstance(doc, dict) else type(doc).__name__
        raise PlacementError(f"{path}: neither a placement JSON written by --out (no 'cluster') nor SGLang's "
                             f"expert-location file (no '{SGLANG_KEY}'); it holds {keys}")
    try:
        pl, planned = from_doc(doc)
    except (KeyError, TypeError, ValueError) as e:
        raise PlacementError(f"{path}: not a placement JSON written by --out ({e})") from e
    if planned != cluster or pl.logcnt.shape != (len(moe_layer_ids), num_experts):
        raise PlacementError(f"{path}: planned for {planned.num_gpus} GPUs / {planned.num_nodes} nodes / "
                             f"{planned.num_slots} slots, {pl.logcnt.shape[0]} layers x {pl.logcnt.shape[1]} "
                             f"experts; this plan is for {cluster.num_gpus} / {cluster.num_nodes} / "
                             f"{cluster.num_slots}, {len(moe_layer_ids)} x {num_experts}")
    return pl


def recorded_previous(run: RunFiles, cluster: Cluster, forward_id: int | None = None) -> Placement:
    """The placement run ran at forward_id (None: at its end; each MoE layer's map in force there) for this cluster;
    PlacementError when the run records none (or none that early), or ran another slot count or another
    expert-parallel size than the cluster's GPUs."""
    m = run.manifest
    try:
        phy2log = placement_at(run, forward_id)
    except TraceSchemaError as e:
        raise PlacementError(f"recorded: {e}") from e
    ep = m.parallel.get("ep_size")
    if phy2log.shape[1] != cluster.num_slots or (ep is not None and ep != cluster.num_gpus):
        ran = f"{phy2log.shape[1]} slots" + ("" if ep is None else f" on ep_size={ep}")
        raise PlacementError(f"recorded: run {m.run_id} ran {ran}; this plan is for {cluster.num_slots} slots on "
                             f"{cluster.num_gpus} GPUs")
    return from_phy2log(phy2log, m.num_experts)


def recorded_at_end(con: duckdb.DuckDBPyConnection, runs: dict[str, RunFiles], train: Selection,
                    cluster: Cluster) -> tuple[Placement, str]:
    """The map the training window's last run ran at the window's newest forward (the placement the cluster ran when
    the plan is made, a rebalance inside the later, held-out part of the run not yet seen), and where that was. A
    heat-only run (no forwards) gives its map at its end."""
    run_id = train.runs[-1]
    x = [s for s in train.spans if s.run_id == run_id]
    field = "forward_id" if x[0].field == "forward_id" else "epoch_ns(ts)"
    inside = " OR ".join(f"({field} >= ? AND {field} < ?)" for _ in x)
    found = con.execute(f"SELECT max(forward_id) FROM routes WHERE run_id = ? AND ({inside})",
                        [run_id, *(v for s in x for v in (s.lo, s.hi))]).fetchone()
    forward = None if found is None or found[0] is None else int(found[0])
    at = f"run {run_id}'s recorded placement" + ("" if forward is None else f" at forward {forward}")
    return recorded_previous(runs[run_id], cluster, forward), at


def load_location(path: Path) -> Any:
    """A location file as SGLang's --init-expert-location loads it: a .pt by torch.load (weights only), else JSON."""
    if path.suffix == ".pt":
        import torch  # only SGLang's .pt needs torch

        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises pickle, zip and runtime errors alike
            raise PlacementError(f"{path}: not a torch file SGLang's --init-expert-location loads ({e})") from e
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlacementError(f"{path}: not a JSON placement ({e})") from e


def _from_sglang(table: Any, path: Path, cluster: Cluster, num_hidden_layers: int, moe_layer_ids: tuple[int, ...],
                 num_experts: int) -> Placement:
    """SGLang's [num_hidden_layers, P] map -> the MoE layers' Placement [L, P]."""
    try:
        full = np.asarray(table.numpy() if hasattr(table, "numpy") else table)
    except ValueError as e:  # rows of different lengths
        raise PlacementError(f"{path}: {SGLANG_KEY} must be [layers][slots] integers ({e})") from e
    if full.ndim != 2 or not np.issubdtype(full.dtype, np.integer):
        raise PlacementError(f"{path}: {SGLANG_KEY} must be [layers][slots] integers; it is {full.dtype} of "
                             f"shape {list(full.shape)}")
    if full.shape[0] != num_hidden_layers:
        raise PlacementError(f"{path}: {SGLANG_KEY} has {full.shape[0]} layers; the trace's model has "
                             f"{num_hidden_layers} (SGLang indexes it by layer id, dense layers included)")
    if full.shape[1] != cluster.num_slots:
        raise PlacementError(f"{path}: {SGLANG_KEY} has {full.shape[1]} slots a layer; --slots is "
                             f"{cluster.num_slots}")
    phy2log = full[list(moe_layer_ids)]  # [L, P]
    bad = rows_fault(phy2log, moe_layer_ids, num_experts)
    if bad is not None:  # named by the row SGLang reads, its layer id
        raise PlacementError(f"{path}: {SGLANG_KEY} row {bad[1]} (a MoE layer): {bad[2]}")
    return from_phy2log(phy2log, num_experts)
