"""The trace contract: Arrow schemas and the run manifest.

One dataset folder holds many runs. Each table has its own top-level folder, hive-partitioned by run id, and
each run has one manifest, its commit point (layout.py has the layout and the older one it still reads):

    <root>/run_id=<id>/manifest.json                 what the complete files hold (rewritten atomically)
    <root>/routes/run_id=<id>/part-00000.parquet     routes: one row per (request, token position, MoE layer)
    <root>/rollups/run_id=<id>/rollup-00000.parquet  per (window, layer, expert, phase): count, heat without a scan
    <root>/requests/run_id=<id>/requests-00000.parquet one row per finished request: tag (domain), token counts
    <root>/placements/run_id=<id>/placement-00000.parquet  the expert placement the engine ran (placements.py)

The schemas below hold run_id; files store them without it (it is the partition, in the path).
Routes are sorted token-major (all MoE layers of a token are adjacent, in `layer_id` order). The
per-request `tag` lives in the requests table rather than on every route row: one string per request
instead of one per (token, layer), 58x fewer for DeepSeek-V3.

The writer lives in writer.py, the readers in reader.py; this file is the schema both agree on.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

# 2: per-table folders, run_id only in the path, shape facts in each file's metadata (layout.py); 1: one folder
SCHEMA_VERSION = 2
PHASES = ("prefill", "decode", "verify")
SOURCES = ("computed", "prefix_cache")
RunKind = Literal["routes", "heat"]
# "recording": a writer holds the run open (or died holding it: reader.run_state tells which); "closed": done.
RunStatus = Literal["recording", "closed"]
# Parquet settings measured in bench/analysis.py: zstd 3 gives ~1 byte per expert id on V3-shaped traces.
PARQUET_COMPRESSION = "zstd"
PARQUET_COMPRESSION_LEVEL = 3
ROW_GROUP_ROWS = 128 * 1024
MANIFEST_NAME = "manifest.json"


class TraceSchemaError(ValueError):
    """A trace, a manifest or an input batch disagrees with the contract; the message names the field."""


class TraceStateError(RuntimeError):
    """start_trace while a trace records, or stop_trace while none does (HTTP 409)."""


def _dict_type() -> pa.DataType:
    return pa.dictionary(pa.int32(), pa.string())


def route_schema(k: int, with_weights: bool, with_physical_ids: bool = False) -> pa.Schema:
    """Schema of the routes files. k: top-k (K); topk_ids are logical ids in gate-rank order. physical_ids
    (with_physical_ids): the physical expert slot (0..P-1) each pair of topk_ids was sent to, entry for entry."""
    fields = [
        pa.field("run_id", _dict_type(), nullable=False),
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("token_pos", pa.int32(), nullable=False),
        pa.field("phase", _dict_type(), nullable=False),
        pa.field("source", _dict_type(), nullable=False),
        pa.field("forward_id", pa.int64(), nullable=False),
        pa.field("ts", pa.timestamp("ns"), nullable=False),
        pa.field("dp_rank", pa.int16(), nullable=False),
        pa.field("layer_id", pa.int16(), nullable=False),
        pa.field("topk_ids", pa.list_(pa.int32(), k), nullable=False),
    ]
    if with_weights:
        fields.append(pa.field("topk_weights", pa.list_(pa.float16(), k), nullable=False))
    if with_physical_ids:
        fields.append(pa.field("physical_ids", pa.list_(pa.int32(), k), nullable=False))
    return pa.schema(fields)


ROLLUP_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("window_start", pa.timestamp("ns"), nullable=False),
        pa.field("layer_id", pa.int16(), nullable=False),
        pa.field("expert_id", pa.int32(), nullable=False),
        pa.field("phase", pa.string(), nullable=False),
        pa.field("count", pa.int64(), nullable=False),
    ]
)

REQUEST_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("tag", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("arrival_ts", pa.timestamp("ns")),
        pa.field("finish_ts", pa.timestamp("ns")),
        # prompt + output token ids: what `r3trace replay-check` feeds the model to recompute routes
        pa.field("token_ids", pa.list_(pa.int32())),
    ]
)


@dataclass(frozen=True)
class FileEntry:
    """One complete routes file and the rollup / requests files closed with it."""

    name: str
    rows: int
    rollup: str | None = None
    requests: str | None = None
    min_forward_id: int = -1
    max_forward_id: int = -1
    level: int = 0  # 0: one group commit; n + 1: a compaction of level-n files (writer.py)


@dataclass(frozen=True)
class Manifest:
    """manifest.json of one run. moe_layer_ids: model layer indices of the L MoE layers, ascending."""

    run_id: str
    model_name: str
    num_hidden_layers: int
    moe_layer_ids: tuple[int, ...]
    num_experts: int  # E, logical routed experts per layer
    top_k: int  # K
    config_hash: str = ""
    schema_version: int = SCHEMA_VERSION
    kind: RunKind = "routes"
    id_space: str = "logical"
    dtype: str = "int32"
    with_weights: bool = False
    with_physical_ids: bool = False  # routes carry physical_ids beside topk_ids (EngineConfig.capture_physical_ids)
    rollup_window_ns: int = 1_000_000_000
    num_groups: int = 1  # expert groups of group-limited routing (DeepSeek-V3: 8)
    engine: dict[str, Any] = field(default_factory=dict)
    parallel: dict[str, Any] = field(default_factory=dict)
    start_time: str = ""
    end_time: str = ""
    rows: int = 0
    files: tuple[FileEntry, ...] = ()
    # Durability (writer.py): how often finished requests are committed, whether commits are fsynced, and the
    # requests whose rows are in listed files with no requests-table row yet (in flight at the last commit).
    status: RunStatus = "closed"
    flush_interval_s: float | None = None
    fsync: bool = True
    open_requests: tuple[str, ...] = ()
    # placements.py: the files of the placements table, in the order written (each listed once written)
    placements: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_experts <= 0 or self.top_k <= 0 or self.top_k > self.num_experts:
            raise TraceSchemaError(
                f"manifest top_k={self.top_k} must be in 1..num_experts={self.num_experts}"
            )
        ids = list(self.moe_layer_ids)
        if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= self.num_hidden_layers:
            raise TraceSchemaError(
                f"manifest moe_layer_ids={ids} must be ascending, unique, in 0..{self.num_hidden_layers - 1}"
            )
        if self.id_space != "logical":
            raise TraceSchemaError(f"manifest id_space={self.id_space!r}, only 'logical' is defined")
        if self.schema_version > SCHEMA_VERSION:
            raise TraceSchemaError(
                f"manifest schema_version={self.schema_version} is newer than this reader ({SCHEMA_VERSION})"
            )
        if self.status not in ("recording", "closed"):
            raise TraceSchemaError(f"manifest status={self.status!r} must be 'recording' or 'closed'")
        if self.num_experts % self.num_groups:
            raise TraceSchemaError(
                f"manifest num_groups={self.num_groups} does not divide num_experts={self.num_experts}"
            )

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def file_count(self) -> int:
        return len(self.files)

    def to_json(self) -> str:
        d = asdict(self)
        d["file_count"] = self.file_count
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        d = dict(d)
        d.pop("file_count", None)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise TraceSchemaError(f"manifest has unknown fields {unknown}")
        d["moe_layer_ids"] = tuple(d.get("moe_layer_ids", ()))
        d["files"] = tuple(FileEntry(**f) for f in d.get("files", ()))
        d["open_requests"] = tuple(d.get("open_requests", ()))
        d["placements"] = tuple(d.get("placements", ()))
        return cls(**d)

    @classmethod
    def read(cls, run_dir: str | Path) -> Manifest:
        path = Path(run_dir) / MANIFEST_NAME
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise TraceSchemaError(f"manifest {path} unreadable: {e}") from e

    def write(self, run_dir: str | Path) -> None:
        """Atomic: a reader sees the old manifest or the new one, never a mix (tmp + fsync + rename)."""
        write_atomic(Path(run_dir) / MANIFEST_NAME, self.to_json().encode(), fsync=self.fsync)


def write_atomic(path: Path, data: bytes, fsync: bool = True) -> None:
    """tmp + (fsync) + rename: a reader sees the old file or the new one. fsync=False keeps the kill -9
    guarantee (the page cache outlives the process) and drops the power-loss one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file's data, or a folder's entries (a rename in it), so they survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_dir_name(run_id: str) -> str:
    if not run_id or "/" in run_id or "=" in run_id or run_id.startswith("."):
        raise TraceSchemaError(f"run_id={run_id!r} must be non-empty without '/', '=' or a leading '.'")
    return f"run_id={run_id}"
