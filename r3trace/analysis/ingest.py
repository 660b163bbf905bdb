"""Ingest routes from elsewhere into a store folder, all-or-nothing.

Every ingest writes into `<store>/.staging-<id>/` (invisible to readers: they look for `run_id=*`) and
renames the finished run folders into place only after the last row validated; on any error the staging
folder is removed, so a malformed input leaves nothing behind.

Sources: our own sink's runs (native); JSON lines of response bodies from SGLang (/generate meta_info, OpenAI
sglext), r3trace and vLLM (per-choice .npy), decoded by peer_formats.py, dense layers dropped by the model's
layer layout; SGLang expert-distribution dumps (.pt, per-layer logical counts) as heat-only runs; numpy .npz
with topk_ids [T, L, K] (ingest_numpy.py).

Time, kept on every path (docs/cli.md, "Ingest keeps time"): native runs keep their ts; a response body's rows get
its `created` (OpenAI and vLLM bodies: Unix seconds) and forward_id = the body's line number (line order as
forward index: bodies do not say which forward produced a row); a body without `created` (SGLang /generate)
gets the ingest start time. A dump's heat is stamped with the time in SGLang's file name
(expert_distribution_recorder_<time.time()>.pt), else the file's modification time. A .npz takes `ts` or
`window_id` per token or per forward (ingest_numpy.py); without either every row gets the ingest start time and
forward_id = the token's row (or the npz's forward_id).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3trace.analysis.peer_formats import BodyError, Format, Routes, detect, moe_rows, routes_of
from r3trace.progress import progress_bar
from r3trace.trace.batch import repeated_experts, repeated_tokens
from r3trace.trace.layout import TABLES
from r3trace.trace.reader import RunFiles, open_dataset
from r3trace.trace.schema import Manifest, TraceSchemaError, run_dir_name
from r3trace.trace.writer import TraceWriter


class IngestError(ValueError):
    """Malformed input; the message names the file, the line and the field."""


def unrepeated(ids: np.ndarray, first: int, where: str, field: str, layer_ids: Sequence[int], drop: bool) -> np.ndarray:
    """ids [T, L, K] of tokens first.. (MoE layers layer_ids) -> keep [T]: the tokens whose top-K names K distinct
    experts on every MoE layer. A repeat is a broken capture (trace/batch.py's repeated_experts): refused with an
    IngestError naming the first one and counting the rest, or with drop (`--drop-repeated`) the token left out."""
    bad, zero = repeated_tokens(ids)  # [T], [T]
    keep = np.logical_not(bad)
    if drop or keep.all():
        return keep
    t = int(np.flatnonzero(bad)[0])
    layer = int(np.flatnonzero(repeated_experts(ids[t]))[0])
    row = np.sort(ids[t, layer])
    zeros = int(zero.sum())
    raise IngestError(f"{where}: {field} repeats expert {int(row[1:][row[1:] == row[:-1]][0])} in token {first + t}'s "
                      f"top-{ids.shape[-1]} on MoE layer {layer} (of {ids.shape[1]}; model layer {layer_ids[layer]}): "
                      f"a router picks {ids.shape[-1]} distinct experts; {int((~keep).sum())} of {len(ids)} tokens "
                      f"here repeat one, {zeros} of them all zeros (SGLang's and vLLM's capture buffers return zeros "
                      "for KV slots never written; swapped layer and top-k axes repeat too); --drop-repeated ingests "
                      "the others")


@dataclass(frozen=True)
class ModelShape:
    """What a response's flat routed_experts means: [rows, num_hidden_layers, K], MoE layers as listed."""

    num_hidden_layers: int
    moe_layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int
    model_name: str = "unknown"
    num_groups: int = 1


@contextmanager
def staged(store: str | Path) -> Iterator[Path]:
    """A staging folder inside `store`; its run folders move into `store` when the block ends cleanly."""
    store = Path(store)
    stage = store / f".staging-{uuid.uuid4().hex[:12]}"
    stage.mkdir(parents=True)
    try:
        yield stage
        for run in sorted(stage.glob("run_id=*")):
            if (store / run.name).exists():
                raise IngestError(f"{run.name} already exists in store {store}")
        for run in sorted(stage.glob("run_id=*")):
            for table in TABLES:  # the data first, the folder that holds the manifest (the commit point) last
                src = stage / table / run.name
                if src.is_dir():
                    (store / table).mkdir(exist_ok=True)
                    shutil.rmtree(store / table / run.name, ignore_errors=True)  # unlisted leftovers of a failed try
                    src.rename(store / table / run.name)
            run.rename(store / run.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def ingest_native(src: str | Path, store: str | Path, progress: bool | None = True) -> list[str]:
    """Copies every complete run under `src` (as its manifest lists it) into `store`; returns run ids.

    `progress` (r3trace/progress.py): a bar of the files copied."""
    runs = open_dataset(src)
    files = {r.run_dir: r.listed_files for r in runs}
    with staged(store) as stage, progress_bar(progress, total=sum(map(len, files.values())), unit="file",
                                              desc="ingest native") as bar:
        for r in runs:
            dst = RunFiles(r.manifest, stage / run_dir_name(r.manifest.run_id))  # same layout, in the stage
            for src, to in zip(files[r.run_dir], dst.listed_files, strict=True):
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, to)
                bar.update()
            dst.run_dir.mkdir(exist_ok=True)
            r.manifest.write(dst.run_dir)
    return [r.manifest.run_id for r in runs]


def _bodies(path: Path, progress: bool | None) -> Iterator[tuple[int, Any]]:
    """(line number, JSON body) of every body line: blank lines, SSE `event:` lines and `data: [DONE]` are
    skipped and a `data: ` prefix is dropped, so a saved event stream reads as it was sent."""
    with open(path, "rb") as f, progress_bar(progress, total=path.stat().st_size, unit="B", unit_scale=True,
                                             desc="ingest") as bar:
        for lineno, line in enumerate(f, start=1):
            bar.update(len(line))
            text = line.strip()
            if text.startswith(b"data:"):
                text = text[5:].strip()
            if not text or text == b"[DONE]" or text.startswith((b"event:", b":")):
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as e:
                raise IngestError(f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno})") from e


@dataclass(frozen=True)
class _Rows:
    """One body's rows of one request, with when they were produced."""

    where: str  # file:line
    routes: Routes
    ts: int  # ns since the epoch: the body's `created`, else the ingest start
    forward_id: int  # the body's line number


def _created_ns(obj: Any, default: int) -> int:
    """An OpenAI-shaped body's `created` (Unix seconds; SGLang's and vLLM's OpenAI protocol set it) in ns."""
    created = obj.get("created") if isinstance(obj, dict) else None
    if isinstance(created, (int, float)) and not isinstance(created, bool) and created > 0:
        return int(created * 1_000_000_000)
    return default


@dataclass
class _Request:
    """What the lines said about one request so far: rows waiting for the prompt length, and its summary."""

    first: str  # file:line of its first body
    pending: list[_Rows]
    required: str = ""  # the field some body of it lacked, when that body promises rows (/generate meta_info)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    rows: int = 0


def ingest_responses(
    path: str | Path, store: str | Path, shape: ModelShape, run_id: str | None = None,
    progress: bool | None = True, fmt: Format | None = None, wire_dtype: str = "int32", drop_repeated: bool = False,
) -> Manifest:
    """JSON lines of response bodies -> one run (r3trace/analysis/peer_formats.py: SGLang /generate, OpenAI-shaped
    with SGLang's sglext or r3trace's sgl_ext, vLLM's per-choice .npy). fmt None detects each line's format.
    Row i of a request is position start + i; positions below its prompt length are prefill, later ones
    decode (rows wait for a later line, such as a streamed usage chunk, when their own line lacks the prompt
    length). ts is the body's `created` (else the ingest start) and forward_id its line number: bodies do not
    say which forward produced a row. `progress`: a bar of the bytes read (r3trace/progress.py). A token whose
    top-K repeats an expert on some MoE layer is refused (`unrepeated`), or with drop_repeated left out and counted
    in the manifest's engine record (dropped_repeated_tokens).
    """
    path = Path(path)
    now = time.time_ns()
    reqs: dict[str, _Request] = {}
    dropped = 0  # tokens left out for a repeated expert (drop_repeated)
    with staged(store) as stage, TraceWriter(  # closed on any exit, before the staging folder goes
        stage, model_name=shape.model_name, num_hidden_layers=shape.num_hidden_layers,
        moe_layer_ids=shape.moe_layer_ids, num_experts=shape.num_experts, top_k=shape.top_k, run_id=run_id,
        num_groups=shape.num_groups, engine={"ingested_from": str(path)},
    ) as w:
        for lineno, obj in _bodies(path, progress):
            where = f"{path}:{lineno}"
            ts = _created_ns(obj, now)
            kind = fmt or detect(obj)
            if kind is None:
                raise IngestError(f"{where}: no route field found (meta_info.routed_experts, sglext.routed_experts, "
                                  "choices[].sgl_ext or choices[].routed_experts); give --format")
            try:
                found = routes_of(obj, kind, (shape.num_hidden_layers, shape.top_k), wire_dtype)
            except BodyError as e:
                raise IngestError(f"{where}: {e}") from e
            for i, r in enumerate(found):
                rid = r.request_id or f"line{lineno}.{i}"
                req = reqs.setdefault(rid, _Request(where, []))
                if r.ids is None and r.field.endswith("meta_info.routed_experts"):
                    req.required = r.field  # a /generate body; its request must get rows from some line
                if r.prompt_tokens is not None:
                    req.prompt_tokens = r.prompt_tokens
                if r.completion_tokens is not None:
                    req.completion_tokens = r.completion_tokens
                req.finish_reason = r.finish_reason or req.finish_reason
                if r.ids is not None:
                    req.pending.append(_Rows(where, r, ts, lineno))
                if req.prompt_tokens is not None:
                    dropped += _write_rows(w, rid, req, shape, drop_repeated)
        for rid, req in reqs.items():
            if req.required and not (req.rows or req.pending):
                raise IngestError(f"{req.first}: field {req.required} missing (was return_routed_experts set?)")
            dropped += _write_rows(w, rid, req, shape, drop_repeated)
            if req.rows:
                w.add_request(rid, prompt_tokens=req.prompt_tokens, completion_tokens=req.completion_tokens,
                              finish_reason=req.finish_reason)
        if not any(req.rows for req in reqs.values()):
            raise IngestError(f"{path}: no routes in any line (was return_routed_experts set?)"
                              + (f"; --drop-repeated left out all {dropped} tokens" if dropped else ""))
        manifest = w.close(engine={"dropped_repeated_tokens": dropped} if drop_repeated else None)
    return manifest


def _write_rows(w: TraceWriter, rid: str, req: _Request, shape: ModelShape, drop_repeated: bool) -> int:
    """Writes the request's pending rows (a row is a token: its MoE layers' top-K); without a prompt length every
    row counts as prefill. -> tokens left out for a repeated expert (drop_repeated; else refused: `unrepeated`)."""
    dropped = 0
    for p in req.pending:
        r = p.routes
        try:
            ids = moe_rows(r, shape.moe_layer_ids, shape.num_experts)  # [rows, L_moe, K]
        except BodyError as e:
            raise IngestError(f"{p.where}: {e}") from e
        pos = r.start + np.arange(len(ids), dtype=np.int32)
        keep = unrepeated(ids, r.start, p.where, f"field {r.field}", shape.moe_layer_ids, drop_repeated)  # [rows]
        ids, pos, dropped = ids[keep], pos[keep], dropped + int((~keep).sum())
        prompt = req.prompt_tokens if req.prompt_tokens is not None else r.start + len(keep)
        try:
            if len(ids):
                w.append_tokens(rid, pos, np.where(pos < prompt, 0, 1), "computed", p.forward_id, p.ts, 0, ids)
        except TraceSchemaError as e:
            raise IngestError(f"{p.where}: {e}") from e
        req.rows += len(ids)
    req.pending.clear()
    return dropped
