"""Ingest routes from elsewhere into a store folder, all-or-nothing.

Every ingest writes into `<store>/.staging-<id>/` (invisible to readers: they look for `run_id=*`) and
renames the finished run folders into place only after the last row validated; on any error the staging
folder is removed, so a malformed input leaves nothing behind.

Sources: our own sink's runs (native); JSON lines of SGLang /generate or OpenAI-style responses carrying
`meta_info.routed_experts` (base64 little-endian int32, [rows, num_hidden_layers, K]; SGLang writes 0 and
we write -1 on dense layers, both dropped here); SGLang expert-distribution dumps (.pt, per-layer logical
counts) as heat-only runs; numpy .npz with topk_ids [T, L, K].
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
import pybase64

from r3trace.progress import progress_bar
from r3trace.trace.commit import write_heat_run
from r3trace.trace.reader import open_dataset
from r3trace.trace.schema import Manifest, TraceSchemaError, run_dir_name
from r3trace.trace.writer import TraceWriter


class IngestError(ValueError):
    """Malformed input; the message names the file, the line and the field."""


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
            run.rename(store / run.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def ingest_native(src: str | Path, store: str | Path, progress: bool | None = True) -> list[str]:
    """Copies every complete run under `src` (as its manifest lists it) into `store`; returns run ids.

    `progress` (r3trace/progress.py): a bar of the files copied."""
    runs = open_dataset(src)
    files = {r.run_dir: [*r.route_files, *r.rollup_files, *r.request_files] for r in runs}
    with staged(store) as stage, progress_bar(progress, total=sum(map(len, files.values())), unit="file",
                                              desc="ingest native") as bar:
        for r in runs:
            dst = stage / run_dir_name(r.manifest.run_id)
            dst.mkdir()
            for p in files[r.run_dir]:
                shutil.copy2(p, dst / p.name)
                bar.update()
            r.manifest.write(dst)
    return [r.manifest.run_id for r in runs]


def _meta_infos(obj: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(meta_info, container) pairs of one JSON line: /generate object or list, or OpenAI choices."""
    if isinstance(obj, list):
        return [m for o in obj for m in _meta_infos(o)]
    if not isinstance(obj, dict):
        return []
    if "meta_info" in obj:
        return [(obj["meta_info"], obj)]
    return [(c.get("meta_info", c), obj) for c in obj.get("choices", []) if isinstance(c, dict)]


def ingest_responses(
    path: str | Path, store: str | Path, shape: ModelShape, run_id: str | None = None,
    progress: bool | None = True,
) -> Manifest:
    """JSON lines of responses -> one run. Row p of a response is the routing of input position p
    (+ routed_experts_start_len); positions below prompt_tokens are prefill, later ones decode.
    forward_id is -1 and ts the ingest time: responses do not say which forward produced a row.
    `progress`: a bar of the bytes read (r3trace/progress.py).
    """
    path = Path(path)
    moe = np.asarray(shape.moe_layer_ids)
    per_row = shape.num_hidden_layers * shape.top_k
    now = time.time_ns()
    with staged(store) as stage, TraceWriter(  # closed on any exit, before the staging folder goes
        stage, model_name=shape.model_name, num_hidden_layers=shape.num_hidden_layers,
        moe_layer_ids=shape.moe_layer_ids, num_experts=shape.num_experts, top_k=shape.top_k, run_id=run_id,
        num_groups=shape.num_groups, engine={"ingested_from": str(path)},
    ) as w:
        with open(path, "rb") as f, progress_bar(progress, total=path.stat().st_size, unit="B", unit_scale=True,
                                                 desc="ingest") as bar:
            for lineno, line in enumerate(f, start=1):
                bar.update(len(line))
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise IngestError(f"{path}:{lineno}: not JSON ({e.msg} at column {e.colno})") from e
                pairs = _meta_infos(obj)
                if not pairs:
                    raise IngestError(f"{path}:{lineno}: field meta_info missing (nor choices[].meta_info)")
                for i, (meta, outer) in enumerate(pairs):
                    _one_response(w, meta, outer, f"{path}:{lineno}", f"line{lineno}.{i}", moe, per_row, shape,
                                  now)
        manifest = w.close()
    return manifest


def _one_response(
    w: TraceWriter, meta: dict[str, Any], outer: dict[str, Any], where: str, fallback_id: str,
    moe: np.ndarray, per_row: int, shape: ModelShape, now: int,
) -> None:
    raw = meta.get("routed_experts")
    if not isinstance(raw, str):
        raise IngestError(f"{where}: field meta_info.routed_experts missing or not a base64 string")
    try:
        flat = np.frombuffer(pybase64.b64decode(raw, validate=True), dtype="<i4")
    except ValueError as e:
        raise IngestError(f"{where}: field meta_info.routed_experts is not valid base64 ({e})") from e
    if flat.size % per_row:
        raise IngestError(
            f"{where}: field meta_info.routed_experts has {flat.size} ids, not a multiple of "
            f"num_hidden_layers x K = {shape.num_hidden_layers} x {shape.top_k} = {per_row}"
        )
    ids = flat.reshape(-1, shape.num_hidden_layers, shape.top_k)[:, moe, :]  # dense layers (0 or -1) dropped
    if ids.size and (ids.min() < 0 or ids.max() >= shape.num_experts):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise IngestError(f"{where}: field meta_info.routed_experts holds id {bad} on a MoE layer, "
                          f"outside 0..{shape.num_experts - 1}")
    rid = str(meta.get("id") or outer.get("id") or fallback_id)
    start = int(meta.get("routed_experts_start_len", 0) or 0)
    prompt = meta.get("prompt_tokens")
    pos = start + np.arange(len(ids), dtype=np.int32)
    phase = np.where(pos < (prompt if isinstance(prompt, int) else len(ids) + start), 0, 1)
    try:
        w.append_tokens(rid, pos, phase, "computed", -1, now, 0, ids)
    except TraceSchemaError as e:
        raise IngestError(f"{where}: {e}") from e
    fin = meta.get("finish_reason")
    w.add_request(rid, prompt_tokens=prompt if isinstance(prompt, int) else None,
                  completion_tokens=meta.get("completion_tokens"),
                  finish_reason=fin.get("type") if isinstance(fin, dict) else fin)


def ingest_expert_distribution(
    path: str | Path, store: str | Path, shape: ModelShape, run_id: str | None = None
) -> Manifest:
    """SGLang expert-distribution dump (.pt dict with `logical_count` [.., layers, E]) -> heat-only run."""
    import torch  # only this source needs torch

    try:
        dump = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise IngestError(f"{path}: not a torch dump ({e})") from e
    counts = dump.get("logical_count") if isinstance(dump, dict) else None
    if counts is None:
        keys = list(dump) if isinstance(dump, dict) else type(dump).__name__
        raise IngestError(f"{path}: field logical_count missing (found {keys})")
    c = np.asarray(counts, dtype=np.int64)
    c = c.reshape(-1, *c.shape[-2:]).sum(0)  # per-pass dumps [passes, layers, E] sum to [layers, E]
    if c.shape[-1] != shape.num_experts:
        raise IngestError(f"{path}: field logical_count has {c.shape[-1]} experts, expected {shape.num_experts}")
    if c.shape[0] == shape.num_hidden_layers:
        c = c[list(shape.moe_layer_ids)]
    elif c.shape[0] != len(shape.moe_layer_ids):
        raise IngestError(f"{path}: field logical_count has {c.shape[0]} layers, expected "
                          f"{shape.num_hidden_layers} (all) or {len(shape.moe_layer_ids)} (MoE)")
    m = Manifest(run_id=run_id or f"heat-{uuid.uuid4().hex[:8]}", model_name=shape.model_name,
                 num_hidden_layers=shape.num_hidden_layers, moe_layer_ids=shape.moe_layer_ids,
                 num_experts=shape.num_experts, top_k=shape.top_k, num_groups=shape.num_groups, kind="heat",
                 engine={"ingested_from": str(path)})
    with staged(store) as stage:
        out = write_heat_run(stage, m, c, window_start_ns=time.time_ns())
    return out


def ingest_numpy(
    path: str | Path, store: str | Path, shape: ModelShape, run_id: str | None = None,
    request_ids: Sequence[str] | None = None, progress: bool | None = True,
) -> Manifest:
    """.npz with `topk_ids` [T, L, K] (optional request_id [T], token_pos [T], forward_id [T]) -> one run.

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
    with staged(store) as stage, TraceWriter(  # offline and staged: commits on size and at close only
        stage, model_name=shape.model_name, num_hidden_layers=shape.num_hidden_layers,
        moe_layer_ids=shape.moe_layer_ids, num_experts=shape.num_experts, top_k=shape.top_k, run_id=run_id,
        num_groups=shape.num_groups, engine={"ingested_from": str(path)}, flush_interval_s=None,
    ) as w:
        try:
            with progress_bar(progress, total=t, desc="ingest numpy", unit="tok") as bar:
                for lo in range(0, t, 16384):
                    sl = slice(lo, lo + 16384)
                    w.append_tokens(rid if isinstance(rid, str) else rid[sl], pos[sl], "decode", "computed",
                                    fwd[sl], time.time_ns(), 0, ids[sl])
                    bar.update(len(ids[sl]))
        except TraceSchemaError as e:
            raise IngestError(f"{path}: {e}") from e
        return w.close(mark_unfinished=False)  # arrays carry no request summaries
