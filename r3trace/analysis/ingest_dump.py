"""SGLang expert-distribution dumps into a store, all-or-nothing (ingest.py's staging).

SGLang's recorder (python/sglang/srt/eplb/expert_distribution.py, sgl-project/sglang 02295fe) writes one of two
shapes, by `--expert-distribution-recorder-mode`:
- stat / stat_approx: `expert_distribution_recorder_<time.time()>.pt` on rank 0, {logical_count [passes, layers, E]}
  (a circular buffer: pass order is not kept) -> a heat run, the passes summed into the rollup window of the dump.
- per_pass / per_token: `expert_distribution_recorder_<time.time()>_<rank>.pt` on every rank, {records: one dict a
  forward pass, last_physical_to_logical_map [layers, P]}. Each record: forward_pass_id, rank and
  global_physical_count [layers, P]; per_token adds input_ids, positions, extend_seq_lens (None outside extend),
  forward_mode and topk_ids_of_layer [layers, tokens, 8] (physical slots; -1 past the model's top-k and on dense
  layers). per_pass -> a heat run, each dump's passes summed into its window (its slots read through its map).
  per_token -> a routes run: forward_id = forward_pass_id, ts = the dump's time, dp_rank = rank, physical_ids = the
  recorded slots, topk_ids = those slots read through the dump's map, and the map itself as a placements row from
  the dump's first forward_pass_id.

The map is SGLang's last one ("may change during recording", its comment): passes recorded before a rebalance inside
one dump are read through the map after it, as SGLang's own stat conversion does. Dumps taken between rebalances each
carry their own map, and each becomes its own placements row. SGLang records no request ids (its TODO): a row's
request is `sglang-r<rank>-f<forward_pass_id>-s<sequence>`, a sequence being one extend_seq_lens entry (one token
outside extend). A folder ingests every `*.pt` in it into one run (the ranks' files of one dump, and later dumps).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np

from r3trace.analysis.ingest import IngestError, ModelShape, staged, unrepeated
from r3trace.phy2log import rows_fault
from r3trace.trace.commit import write_heat_run
from r3trace.trace.schema import Manifest, TraceSchemaError
from r3trace.trace.writer import TraceWriter

DUMP_NAME = re.compile(r"expert_distribution_recorder_(\d+(?:\.\d+)?)(?:_\d+)?\.pt$")
SLOTS_A_TOKEN = 8  # _DetailSinglePassGatherer._TOP_K_NUM: SGLang keeps 8 ids a token, -1 past the model's top-k
# ForwardMode values (model_executor/forward_batch_info.py): EXTEND 1, DECODE 2, MIXED 3, IDLE 4, TARGET_VERIFY 5,
# SPLIT_PREFILL 8. MIXED is chunked prefill with decodes folded in as one-token extends: those rows are decode.
PHASE_OF_MODE = {1: "prefill", 2: "decode", 3: "mixed", 5: "verify", 8: "prefill"}
IDLE_MODE = 4
TOKEN_KEYS = ("forward_pass_id", "rank", "global_physical_count", "positions", "forward_mode", "topk_ids_of_layer")


@dataclass(frozen=True)
class Dump:
    path: Path
    ts_ns: int  # the time in SGLang's file name, else the file's modification time
    body: Any


def dump_time_ns(path: Path) -> int:
    """When SGLang wrote a dump: the time.time() in its file name (expert_distribution_recorder_<time.time()>.pt,
    `_<rank>` before `.pt` for per_pass / per_token), else the file's modification time."""
    found = DUMP_NAME.search(path.name)
    return int(Decimal(found.group(1)) * 1_000_000_000) if found else path.stat().st_mtime_ns


def ingest_expert_distribution(
    src: str | Path, store: str | Path, shape: ModelShape, run_id: str | None = None
) -> Manifest:
    """A dump file, or a folder of them (every *.pt, one recorder mode) -> one run (the module docstring)."""
    dumps = _load(Path(src))
    kinds = {_kind(d) for d in dumps}
    if len(kinds) > 1:
        raise IngestError(f"{src}: dumps of {len(kinds)} recorder modes ({', '.join(sorted(kinds))}); ingest one "
                          "mode at a time")
    kind = kinds.pop()
    run_id = run_id or f"{'routes' if kind == 'per_token' else 'heat'}-{uuid.uuid4().hex[:8]}"
    engine = {"ingested_from": str(src), "sglang_recorder_mode": kind}
    if kind == "per_token":
        return _routes_run(dumps, store, shape, run_id, engine, src)
    copies: list[tuple[int, int, Any]] = []  # per_pass: (rank, forward_pass_id, slot counts) for _one_copy
    windows = [(d.ts_ns, _stat_counts(d, shape) if kind == "stat" else _pass_counts(d, shape, copies)) for d in dumps]
    if kind == "per_pass":
        _one_copy(copies, src)
    m = Manifest(run_id=run_id, model_name=shape.model_name, num_hidden_layers=shape.num_hidden_layers,
                 moe_layer_ids=shape.moe_layer_ids, num_experts=shape.num_experts, top_k=shape.top_k,
                 num_groups=shape.num_groups, kind="heat", engine=engine)
    with staged(store) as stage:
        return write_heat_run(stage, m, np.stack([c for _, c in windows]), window_start_ns=[t for t, _ in windows])


def _load(src: Path) -> list[Dump]:
    import torch  # only dumps need torch

    if not src.exists():
        raise IngestError(f"src {src} does not exist")
    paths = sorted(src.glob("*.pt")) if src.is_dir() else [src]
    if not paths:
        raise IngestError(f"src {src}: a folder with no .pt dump in it")
    out = []
    for p in paths:
        try:
            body = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises pickle, zip and runtime errors alike
            raise IngestError(f"{p}: not a torch dump ({e})") from e
        out.append(Dump(p, dump_time_ns(p), body))
    return sorted(out, key=lambda d: (d.ts_ns, d.path.name))


def _kind(d: Dump) -> str:
    body = d.body
    if isinstance(body, dict) and "logical_count" in body:
        return "stat"
    if isinstance(body, dict) and "records" in body:
        if "last_physical_to_logical_map" not in body:
            raise IngestError(f"{d.path}: field last_physical_to_logical_map missing beside records")
        recs = body["records"]
        if not isinstance(recs, list) or not all(isinstance(r, dict) for r in recs):
            raise IngestError(f"{d.path}: field records must be a list of dicts, one a forward pass")
        return "per_token" if any("topk_ids_of_layer" in r for r in recs) else "per_pass"
    keys = list(body) if isinstance(body, dict) else type(body).__name__
    raise IngestError(f"{d.path}: fields logical_count (stat) or records (per_pass, per_token) missing (found {keys})")


def _layers(n: int, shape: ModelShape, where: str, field: str) -> list[int]:
    """Rows of an SGLang [layers, ..] tensor that hold the MoE layers: it has every layer or only the MoE ones."""
    if n == shape.num_hidden_layers:
        return list(shape.moe_layer_ids)
    if n == len(shape.moe_layer_ids):
        return list(range(n))
    raise IngestError(f"{where}: field {field} has {n} layers, expected {shape.num_hidden_layers} (all) or "
                      f"{len(shape.moe_layer_ids)} (MoE)")


def _array(value: Any, where: str, field: str, ndim: int) -> np.ndarray:
    a = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    if a.ndim != ndim or not np.issubdtype(a.dtype, np.integer):
        raise IngestError(f"{where}: field {field} must be {ndim}-d integers; it is {a.dtype} of shape {list(a.shape)}")
    return a.astype(np.int64)


def _stat_counts(d: Dump, shape: ModelShape) -> np.ndarray:
    """A stat dump's logical_count [passes, layers, E] (or [layers, E]) -> [L, E] over the MoE layers."""
    c = np.asarray(d.body["logical_count"], dtype=np.int64)
    c = c.reshape(-1, *c.shape[-2:]).sum(0)
    if c.shape[-1] != shape.num_experts:
        raise IngestError(f"{d.path}: field logical_count has {c.shape[-1]} experts, expected {shape.num_experts}")
    return c[_layers(c.shape[0], shape, str(d.path), "logical_count")]


def _map(d: Dump, shape: ModelShape) -> np.ndarray:
    """The dump's last_physical_to_logical_map over the MoE layers [L, P]: each slot an expert, each expert a slot."""
    full = _array(d.body["last_physical_to_logical_map"], str(d.path), "last_physical_to_logical_map", 2)
    moe = full[_layers(len(full), shape, str(d.path), "last_physical_to_logical_map")]
    bad = rows_fault(moe, shape.moe_layer_ids, shape.num_experts)
    if bad is not None:
        raise IngestError(f"{d.path}: field last_physical_to_logical_map row {bad[1]} (a MoE layer): {bad[2]}")
    return moe


def _logical(slot_counts: np.ndarray, phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """Per-slot counts [L, P] -> per-expert counts [L, E] through phy2log [L, P]."""
    flat = (np.arange(len(phy2log))[:, None] * num_experts + phy2log).ravel()
    return np.bincount(flat, weights=slot_counts.ravel(), minlength=len(phy2log) * num_experts).reshape(
        len(phy2log), num_experts).astype(np.int64)


def _records(d: Dump, keys: tuple[str, ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    for i, r in enumerate(d.body["records"]):
        where = f"{d.path}: records[{i}]"
        missing = [k for k in keys if k not in r]
        if missing:
            raise IngestError(f"{where}: field {missing[0]} missing (found {list(r)})")
        yield where, r


def _pass_counts(d: Dump, shape: ModelShape, copies: list[tuple[int, int, Any]]) -> np.ndarray:
    """A per_pass dump's global_physical_count summed over its passes, read through its map -> [L, E]; each pass's
    (rank, forward_pass_id, counts) appended to copies."""
    phy2log = _map(d, shape)
    total = np.zeros(phy2log.shape, dtype=np.int64)
    for where, r in _records(d, ("forward_pass_id", "rank", "global_physical_count")):
        gpc = _slot_counts(r, where, shape)
        copies.append((int(r["rank"]), int(r["forward_pass_id"]), gpc))
        if gpc.shape != total.shape:
            raise IngestError(f"{where}: field global_physical_count is {list(gpc.shape)}, the map's MoE layers "
                              f"{list(phy2log.shape)}")
        total += gpc
    return _logical(total, phy2log, shape.num_experts)


def _slot_counts(r: dict[str, Any], where: str, shape: ModelShape) -> np.ndarray:
    """A record's global_physical_count over the MoE layers [L, P]."""
    gpc = _array(r["global_physical_count"], where, "global_physical_count", 2)
    return gpc[_layers(len(gpc), shape, where, "global_physical_count")]


def _one_copy(passes: list[tuple[int, int, Any]], src: str | Path) -> None:
    """Refuses ranks that recorded the same thing in every pass they share: SGLang without DP attention runs the
    whole batch on every TP rank, and each rank's file holds it; summing them would count every token tp times."""
    by_pass: dict[int, list[tuple[int, bytes]]] = {}
    for rank, fp, value in passes:
        a = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
        if a.any():  # an idle DP rank's pass (all zeros) says nothing either way
            by_pass.setdefault(int(fp), []).append((int(rank), a.tobytes() + str(a.shape).encode()))
    shared = [v for v in by_pass.values() if len(v) > 1]
    if shared and all(len({b for _, b in v}) == 1 for v in shared):
        ranks = sorted({r for v in shared for r, _ in v})
        raise IngestError(f"{src}: ranks {', '.join(map(str, ranks))} recorded the same tokens in all "
                          f"{len(shared)} passes they share (SGLang without DP attention: every TP rank records the "
                          "whole batch); ingest one rank's file")


def _routes_run(dumps: list[Dump], store: str | Path, shape: ModelShape, run_id: str, engine: dict[str, Any],
                src: str | Path) -> Manifest:
    seen: dict[tuple[int, int], str] = {}
    copies: list[tuple[int, int, Any]] = []
    with staged(store) as stage, TraceWriter(  # offline and staged: commits on size and at close only
        stage, model_name=shape.model_name, num_hidden_layers=shape.num_hidden_layers,
        moe_layer_ids=shape.moe_layer_ids, num_experts=shape.num_experts, top_k=shape.top_k, run_id=run_id,
        num_groups=shape.num_groups, with_physical_ids=True, flush_interval_s=None,
        engine={**engine, "ts_from": "the time in each dump's file name, else its modification time",
                "placement": "each dump's last_physical_to_logical_map, from its first forward_pass_id"},
    ) as w:
        maps: dict[int, np.ndarray] = {}  # first forward_pass_id of a dump -> its map
        try:
            for d in dumps:
                phy2log = _map(d, shape)
                first = None
                for where, r in _records(d, TOKEN_KEYS):
                    key = (int(r["rank"]), int(r["forward_pass_id"]))
                    if key in seen:
                        raise IngestError(f"{where}: rank {key[0]} forward_pass_id {key[1]} is already in "
                                          f"{seen[key]}")
                    seen[key] = where
                    first = key[1] if first is None else min(first, key[1])
                    rows = _token_rows(r, where, shape, phy2log)
                    if rows is not None:
                        rids, pos, phase, logical, phys, copy = rows
                        copies.append((key[0], key[1], copy))
                        w.append_tokens(rids, pos, phase, "computed", key[1], d.ts_ns, key[0], logical,
                                        physical_ids=phys)
                if first is not None:
                    _add_map(w, maps, first, phy2log, shape, d.path)
        except TraceSchemaError as e:
            raise IngestError(f"{src}: {e}") from e
        _one_copy(copies, src)
        return w.close(mark_unfinished=False)


def _add_map(w: TraceWriter, maps: dict[int, np.ndarray], first: int, phy2log: np.ndarray, shape: ModelShape,
             path: Path) -> None:
    """The dump's map as a placements row from its first pass; the ranks' files of one dump write it once."""
    if first in maps:
        if not np.array_equal(maps[first], phy2log):
            raise IngestError(f"{path}: field last_physical_to_logical_map differs from another rank's dump starting "
                              f"at forward_pass_id {first}")
        return
    maps[first] = phy2log
    w.add_placement(first, shape.moe_layer_ids, phy2log)


def _token_rows(r: dict[str, Any], where: str, shape: ModelShape, phy2log: np.ndarray
                ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """One per_token record -> (request ids, positions, phases, topk_ids [T, L, K], physical_ids [T, L, K], the
    record's slots and positions for the one-copy check); None for an idle pass."""
    mode = int(r["forward_mode"])
    if mode == IDLE_MODE:
        return None
    if mode not in PHASE_OF_MODE:
        raise IngestError(f"{where}: field forward_mode is {mode}; r3trace reads {sorted(PHASE_OF_MODE)} (extend, "
                          "decode, mixed, target verify, split prefill) and idle (4)")
    topk = _array(r["topk_ids_of_layer"], where, "topk_ids_of_layer", 3)  # [layers, T, 8]
    pos = np.asarray(r["positions"], dtype=np.int64)
    t, k, p = topk.shape[1], shape.top_k, phy2log.shape[1]
    if t == 0 and not len(pos):
        return None  # a DP rank with no tokens this pass
    if len(pos) != t or topk.shape[2] < k:
        raise IngestError(f"{where}: field topk_ids_of_layer is {list(topk.shape)}: expected [layers, "
                          f"{len(pos)} positions, >= top_k {k}]")
    rows = _layers(len(topk), shape, where, "topk_ids_of_layer")
    other = np.delete(topk, rows, axis=0)  # dense layers: SGLang leaves their -1s
    if (other != -1).any() or (topk[rows][:, :, k:] != -1).any():
        what = "a dense layer" if (other != -1).any() else f"a column past top_k {k}"
        raise IngestError(f"{where}: field topk_ids_of_layer holds an expert on {what} (give --top-k and the layer "
                          "layout of the model SGLang ran)")
    phys = topk[rows][:, :, :k].transpose(1, 0, 2)  # [T, L, K]
    if phys.min() < 0 or phys.max() >= p:  # t > 0 here
        slot = int(phys.min() if phys.min() < 0 else phys.max())
        raise IngestError(f"{where}: field topk_ids_of_layer holds slot {slot}: slots are 0..{p - 1} (the map's width)")
    gpc = _slot_counts(r, where, shape)
    flat = (np.arange(len(rows))[None, :, None] * p + phys).ravel()
    if gpc.shape != phy2log.shape or not np.array_equal(np.bincount(flat, minlength=phy2log.size), gpc.ravel()):
        raise IngestError(f"{where}: field global_physical_count disagrees with topk_ids_of_layer (a torn record)")
    logical = phy2log[np.arange(len(rows))[None, :, None], phys]  # [T, L, K]
    unrepeated(logical, 0, where, "topk_ids_of_layer", shape.moe_layer_ids, drop=False)
    lens = r.get("extend_seq_lens")
    lens = np.ones(t, dtype=np.int64) if lens is None else np.asarray(lens, dtype=np.int64)
    if lens.sum() != t or (lens < 1).any():
        raise IngestError(f"{where}: field extend_seq_lens sums to {int(lens.sum())}, the pass has {t} tokens")
    seq = np.repeat(np.arange(len(lens)), lens)  # [T]
    phase = np.array([PHASE_OF_MODE[mode]] * t, dtype=object)
    if mode == 3:
        phase = np.where(lens[seq] == 1, "decode", "prefill")
    prefix = f"sglang-r{int(r['rank'])}-f{int(r['forward_pass_id'])}-s"
    return ([f"{prefix}{s}" for s in seq.tolist()], pos, phase, logical, phys,
            np.concatenate([pos[:, None], phys.reshape(t, -1)], axis=1))
