"""The placements table: which logical expert each physical slot held, per MoE layer, from which forward on.

An engine records the map in force when a trace starts (every MoE layer; the trivial map, slot e holds expert e,
when it runs none) and, during a rebalance while serving, each chunk's new rows the moment its layers switch:

    <root>/placements/run_id=<id>/placement-00000.parquet   one row per (from_forward_id, layer_id)

The map of layer l at forward f is l's row with the largest from_forward_id <= f. A rebalance switches a layer
between two forwards on every rank at once (engine/expert_placement.py), so a route row's physical_ids name slots of
that map: for each row, phy2log[physical_id] == topk_id (tests/engine/test_trace_placements.py). SGLang's
expert-distribution dump keeps one map, its last ("may change during recording": expert_distribution.py,
_DetailAccumulator.dump); here every map a trace ran under is kept.

A file is written (tmp, fsync, rename) and listed by a manifest write before TraceWriter.add_placement returns, so
a kill never loses a recorded map; a rebalance writes one file a chunk (a few a minute at most), never compacted.
Plain SQL reads it like every table: read_parquet('<root>/placements/**/*.parquet', hive_partitioning=true).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from r3trace.phy2log import rows_fault
from r3trace.trace.layout import without_partition
from r3trace.trace.schema import Manifest, TraceSchemaError

PLACEMENT_SCHEMA = pa.schema([
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("from_forward_id", pa.int64(), nullable=False),  # the first forward that ran under this row
    pa.field("ts", pa.timestamp("ns"), nullable=False),  # when the engine switched (or the trace started)
    pa.field("layer_id", pa.int16(), nullable=False),
    pa.field("phy2log", pa.list_(pa.int32()), nullable=False),  # [P] the logical expert of each physical slot
])


def placement_table(m: Manifest, from_forward_id: int, ts_ns: int, layer_ids: Sequence[int], phy2log: Any) -> pa.Table:
    """Rows of one switch: phy2log [n, P] for the n MoE layers in layer_ids. TraceSchemaError naming the field: a
    layer outside the manifest's MoE layers, an expert id outside 0..E-1, a row that gives an expert no slot."""
    ids = [int(x) for x in layer_ids]
    table = np.asarray(phy2log)
    if not isinstance(from_forward_id, (int, np.integer)) or from_forward_id < 0:
        raise TraceSchemaError(f"placement from_forward_id={from_forward_id!r} must be an integer >= 0")
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer) or table.shape[0] != len(ids):
        raise TraceSchemaError(f"placement phy2log must be [{len(ids)} layers, P slots] integers; it is "
                               f"{table.dtype} of shape {list(table.shape)}")
    outside = sorted(set(ids) - set(m.moe_layer_ids))
    if outside or len(set(ids)) != len(ids) or not ids:
        raise TraceSchemaError(f"placement layer_ids={ids} must be distinct MoE layers of {list(m.moe_layer_ids)}")
    bad = rows_fault(table, ids, m.num_experts)
    if bad is not None:
        raise TraceSchemaError(f"placement phy2log row of layer {bad[1]}: {bad[2]}")
    n = len(ids)
    return pa.table({
        "run_id": pa.array([m.run_id] * n, pa.string()),
        "from_forward_id": pa.array([int(from_forward_id)] * n, pa.int64()),
        "ts": pa.array([int(ts_ns)] * n, pa.int64()).cast(pa.timestamp("ns")),
        "layer_id": pa.array(ids, pa.int16()),
        "phy2log": pa.array(table.astype(np.int32).tolist(), pa.list_(pa.int32())),
    }, schema=PLACEMENT_SCHEMA)


def read_placements(run: Any) -> pa.Table:
    """A run's placements rows (reader.RunFiles) by from_forward_id, rows of one forward in the order written (a
    stable sort): the later of two rows for one layer and forward is the map that forward ran. None: zero rows."""
    files = run.placement_files
    if not files:
        return without_partition(PLACEMENT_SCHEMA).empty_table()
    t = pa.concat_tables([pq.read_table(p).cast(without_partition(PLACEMENT_SCHEMA)) for p in files])
    return t.take(pc.sort_indices(t, [("from_forward_id", "ascending")]))  # Arrow's sort is stable


def placement_at(run: Any, forward_id: int | None = None) -> np.ndarray:
    """phy2log [L, P] over the manifest's MoE layers: each layer's map in force at forward_id (None: at the run's
    end, each layer's last row). TraceSchemaError when the run records no placement or a layer none that early."""
    m = run.manifest
    last: dict[int, np.ndarray] = {}
    for f, at in forward_rows(run):  # oldest first: later rows win
        if forward_id is not None and f > forward_id:
            break
        last.update(at)
    where = "" if forward_id is None else f" at forward {forward_id}"
    if not last:
        raise TraceSchemaError(f"run {m.run_id} records no expert placement{where} (an r3trace engine writes one "
                               "when a trace starts)")
    missing = [lid for lid in m.moe_layer_ids if lid not in last]
    if missing:
        raise TraceSchemaError(f"run {m.run_id} records no placement of MoE layer {missing[0]}{where}")
    widths = {len(last[lid]) for lid in m.moe_layer_ids}
    if len(widths) != 1:
        raise TraceSchemaError(f"run {m.run_id}: the MoE layers' placements have {sorted(widths)} slots{where}")
    return np.array([last[lid] for lid in m.moe_layer_ids], dtype=np.int64)


class Switch(NamedTuple):
    from_forward_id: int
    layers: int  # MoE layers with a row at this forward
    slots: int  # those layers' slots
    moved: int  # of them, slots whose expert differs from the layer's map before (all, for a layer's first map)


def forward_rows(run: Any) -> list[tuple[int, dict[int, np.ndarray]]]:
    """The run's placement rows by forward, oldest first: (from_forward_id, {layer_id: phy2log [P]}), of two rows of
    one layer and forward the later (read_placements' order)."""
    t = read_placements(run)
    out: list[tuple[int, dict[int, np.ndarray]]] = []
    for f, layer, row in zip(t.column("from_forward_id").to_pylist(), t.column("layer_id").to_pylist(),
                             t.column("phy2log").to_pylist(), strict=True):
        if not out or out[-1][0] != f:
            out.append((int(f), {}))
        out[-1][1][int(layer)] = np.asarray(row)
    return out


def switches(run: Any) -> list[Switch]:
    """The run's placement history, one entry a forward with rows: how many layers it switched and slots it moved
    (the first entry is the map a trace started under: every slot counts as placed)."""
    before: dict[int, np.ndarray] = {}
    out: list[Switch] = []
    for f, at in forward_rows(run):
        moved = sum(int((r != before[lid]).sum()) if lid in before and len(before[lid]) == len(r) else len(r)
                    for lid, r in at.items())
        out.append(Switch(f, len(at), sum(len(r) for r in at.values()), moved))
        before.update(at)
    return out


def history_line(history: list[Switch], shown: int = 4) -> str:
    """The run's recorded placements in one line: the map it started under, then each switch (placements.switches)."""
    first, rest = history[0], history[1:]
    line = f"placements: a map of {first.layers} layers from forward {first.from_forward_id}"
    if not rest:
        return line + ", never switched"
    each = [f"forward {s.from_forward_id} ({s.layers} layer{'s' * (s.layers > 1)}, {s.moved} of {s.slots} slots "
            "moved)" for s in rest[:shown]]
    more = f", and {len(rest) - shown} more" if len(rest) > shown else ""
    return (f"{line}; {len(rest)} switch{'es' * (len(rest) > 1)} moving {sum(s.moved for s in rest)} slots: "
            + ", ".join(each) + more)
