"""Ingest a numpy .npz of routes, with their time, into a store folder, all-or-nothing (ingest.py's staging).

`topk_ids` [T, L, K]; optional request_id [T], token_pos [T], forward_id [T]; time as `ts` or `window_id`, one entry
per token [T] or per forward [F] (docs/cli.md, "Ingest keeps time").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from r3trace.analysis.ingest import IngestError, ModelShape, staged, unrepeated
from r3trace.progress import progress_bar
from r3trace.trace.schema import Manifest, TraceSchemaError
from r3trace.trace.writer import TraceWriter

WINDOW_ID_S = 1.0  # a numpy window id is one rollup window of the run it lands in


def ingest_numpy(
    path: str | Path, store: str | Path, shape: ModelShape, run_id: str | None = None,
    request_ids: Sequence[str] | None = None, progress: bool | None = True, ts: np.ndarray | None = None,
    window_id: np.ndarray | None = None, drop_repeated: bool = False,
) -> Manifest:
    """.npz with `topk_ids` [T, L, K] (optional request_id [T], token_pos [T], forward_id [T], and time: `ts` or
    `window_id`, per token [T] or per forward [F]) -> one run. `ts` / `window_id` given here replace the npz's
    (numpy_times says how each is read). A token whose top-K repeats an expert is refused, or with drop_repeated
    left out and counted in the manifest's engine record (ingest.unrepeated).

    `progress`: a bar of the tokens written (r3trace/progress.py)."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:  # not an .npz, or one holding pickled objects
        raise IngestError(f"{path}: not a .npz of numeric arrays ({e})") from e
    if "topk_ids" not in data:
        raise IngestError(f"{path}: field topk_ids missing (found {list(data.keys())})")
    ids = data["topk_ids"]
    t = len(ids)
    rid = data.get("request_id", request_ids or "r0")
    pos = data["token_pos"] if "token_pos" in data else np.arange(t)
    fwd = data["forward_id"] if "forward_id" in data else np.arange(t)
    given = {"ts": ts if ts is not None else data.get("ts"),
             "window_id": window_id if window_id is not None else data.get("window_id")}
    stamps, ts_from = numpy_times(given["ts"], given["window_id"], np.asarray(fwd), t,
                                  int(WINDOW_ID_S * 1_000_000_000), time.time_ns(), str(path))
    with staged(store) as stage, TraceWriter(  # offline and staged: commits on size and at close only
        stage, model_name=shape.model_name, num_hidden_layers=shape.num_hidden_layers,
        moe_layer_ids=shape.moe_layer_ids, num_experts=shape.num_experts, top_k=shape.top_k, run_id=run_id,
        num_groups=shape.num_groups, engine={"ingested_from": str(path), "ts_from": ts_from},
        flush_interval_s=None, rollup_window_s=WINDOW_ID_S,
    ) as w:
        dropped = 0
        try:
            with progress_bar(progress, total=t, desc="ingest numpy", unit="tok") as bar:
                for lo in range(0, t, 16384):
                    sl = slice(lo, lo + 16384)
                    keep = _distinct(ids[sl], lo, str(path), shape.moe_layer_ids, drop_repeated)  # [T'], None: all
                    dropped += 0 if keep is None else int((~keep).sum())
                    if keep is None or keep.any():
                        w.append_tokens(rid if isinstance(rid, str) else _take(rid, sl, keep), _take(pos, sl, keep),
                                        "decode", "computed", _take(fwd, sl, keep), _take(stamps, sl, keep), 0,
                                        _take(ids, sl, keep))
                    bar.update(len(ids[sl]))
        except TraceSchemaError as e:
            raise IngestError(f"{path}: {e}") from e
        if t and dropped == t:
            raise IngestError(f"{path}: --drop-repeated left out all {t} tokens: every one repeats an expert")
        # arrays carry no request summaries
        return w.close(mark_unfinished=False, engine={"dropped_repeated_tokens": dropped} if drop_repeated else None)


def _take(column: np.ndarray, sl: slice, keep: np.ndarray | None) -> np.ndarray:
    """A per-token column's slice sl, less the tokens keep leaves out; a slice of another length passes whole, for
    the writer to refuse by name."""
    part = np.asarray(column)[sl]
    return part if keep is None or keep.all() or len(part) != len(keep) else part[keep]


def _distinct(ids: np.ndarray, first: int, where: str, layer_ids: Sequence[int], drop: bool) -> np.ndarray | None:
    """ids [T, L, K] of tokens first.. -> ingest.unrepeated's keep [T]; None where another shape or dtype leaves the
    check to the writer, which refuses it by name."""
    if ids.ndim != 3 or ids.dtype.kind not in "iu":
        return None
    return unrepeated(ids, first, where, "column topk_ids", layer_ids, drop)


def numpy_times(ts: np.ndarray | None, window_id: np.ndarray | None, forward_id: np.ndarray, t: int,
                rollup_ns: int, now: int, where: str) -> tuple[np.ndarray, str]:
    """Each token's ts [T] in ns since the epoch, and what it came from.

    ts: integers are ns since the epoch, floats seconds since the epoch, datetime64 as it says. window_id:
    integers >= 0, window w starting at w x the rollup window (1 s), so window w is rollup window w. Either holds
    one entry per token [T] or one per forward [F], F the distinct forward ids in ascending order. Neither: the
    ingest start time for every token (time windows then hold the whole run; forward windows still work)."""
    if ts is not None and window_id is not None:
        raise IngestError(f"{where}: give ts or window_id, not both")
    if ts is None and window_id is None:
        return np.full(t, now, dtype=np.int64), "ingest time (no ts or window_id given)"
    name = "ts" if ts is not None else "window_id"
    raw = np.asarray(ts if ts is not None else window_id)
    if raw.ndim != 1:
        raise IngestError(f"{where}: field {name} has shape {list(raw.shape)}; expected [T] or [F] (one dimension)")
    if raw.dtype.kind == "M":
        ns = raw.astype("datetime64[ns]").astype(np.int64)
    elif raw.dtype.kind in "iu":
        ns = raw.astype(np.int64)
    elif raw.dtype.kind == "f" and name == "ts":
        if not np.isfinite(raw).all():
            raise IngestError(f"{where}: field ts holds NaN or inf")
        ns = np.round(raw.astype(np.float64) * 1e9).astype(np.int64)
    else:
        want = "integers (ns), floats (s) or datetime64" if name == "ts" else "integers"
        raise IngestError(f"{where}: field {name} is {raw.dtype}; expected {want}")
    if name == "window_id":
        if len(ns) and ns.min() < 0:
            raise IngestError(f"{where}: field window_id holds {int(ns.min())}; window ids are >= 0")
        ns = ns * rollup_ns
    forwards, inverse = np.unique(forward_id, return_inverse=True)
    if len(ns) == t:
        return ns, f"{name} per token"
    if len(ns) == len(forwards):
        return ns[inverse], f"{name} per forward"
    raise IngestError(f"{where}: field {name} has {len(ns)} entries; expected T={t} (one per token) or "
                      f"F={len(forwards)} (one per distinct forward_id)")
