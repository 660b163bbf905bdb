"""Per-file heat rollup: count per (time window, layer_id, expert_id, phase).

A V3 file of 1M rows (17K tokens x 58 layers x 8 ids) rolls up to at most 58 x 256 = 15K rows per
(window, phase): heat over a 100M-row trace reads ~1.5M rollup rows instead of 800M ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from r3trace.trace.schema import PHASES, ROLLUP_SCHEMA, TraceSchemaError


class RollupAccumulator:
    """Counts [L, E] per (window index, phase code) for the rows of the file being written."""

    def __init__(self, moe_layer_ids: Sequence[int], num_experts: int, window_ns: int) -> None:
        if window_ns <= 0:
            raise TraceSchemaError(f"rollup window_ns={window_ns} must be > 0")
        self.moe_layer_ids = np.asarray(moe_layer_ids, dtype=np.int16)
        self.num_experts = num_experts
        self.window_ns = window_ns
        # layer_id -> row in [L, E]; -1 marks a layer that is not MoE
        self._layer_index = np.full(int(self.moe_layer_ids.max()) + 1, -1, dtype=np.int64)
        self._layer_index[self.moe_layer_ids] = np.arange(len(self.moe_layer_ids))
        self.counts: dict[tuple[int, int], np.ndarray] = {}

    def add(self, ts_ns: np.ndarray, phase: np.ndarray, layer_id: np.ndarray, topk_ids: np.ndarray) -> None:
        """ts_ns, phase codes, layer_id: [N]; topk_ids [N, K] (already checked against E)."""
        if len(layer_id) == 0:
            return
        lid = np.asarray(layer_id, dtype=np.int64)
        if lid.min() < 0 or lid.max() >= len(self._layer_index) or (self._layer_index[lid] < 0).any():
            bad = lid[(lid < 0) | (lid >= len(self._layer_index))]
            bad = bad if len(bad) else lid[self._layer_index[lid] < 0]
            raise TraceSchemaError(
                f"column layer_id holds {int(bad[0])}, not one of moe_layer_ids {self.moe_layer_ids.tolist()}"
            )
        n_cells = len(self.moe_layer_ids) * self.num_experts
        flat = self._layer_index[lid][:, None] * self.num_experts + topk_ids  # [N, K]
        key = (np.asarray(ts_ns, dtype=np.int64) // self.window_ns) * len(PHASES) + phase
        # one bincount per distinct (window, phase): a forward batch spans 1-2 of them
        uniq = np.unique(key)
        for u in uniq.tolist():
            rows = flat if len(uniq) == 1 else flat[key == u]
            c = np.bincount(rows.ravel(), minlength=n_cells).reshape(len(self.moe_layer_ids), -1)
            self._accumulate((u // len(PHASES), u % len(PHASES)), c)

    def add_tokens(self, ts_ns: np.ndarray, phase: np.ndarray, topk_ids: np.ndarray) -> None:
        """ts_ns, phase codes: [T]; topk_ids [T, L, K] over every MoE layer in order (checked against E)."""
        if len(topk_ids) == 0:
            return
        n_layers = len(self.moe_layer_ids)
        flat = np.arange(n_layers, dtype=np.int64)[None, :, None] * self.num_experts + topk_ids  # [T, L, K]
        key = (np.asarray(ts_ns, dtype=np.int64) // self.window_ns) * len(PHASES) + phase  # [T]
        uniq, inv = np.unique(key, return_inverse=True)
        for j, u in enumerate(uniq.tolist()):
            rows = flat if len(uniq) == 1 else flat[inv == j]
            c = np.bincount(rows.ravel(), minlength=n_layers * self.num_experts).reshape(n_layers, -1)
            self._accumulate((u // len(PHASES), u % len(PHASES)), c)

    def _accumulate(self, slot: tuple[int, int], c: np.ndarray) -> None:
        if slot in self.counts:
            self.counts[slot] += c
        else:
            self.counts[slot] = c.astype(np.int64)

    def table(self, run_id: str) -> pa.Table:
        """Nonzero cells as a ROLLUP_SCHEMA table; then the accumulator is empty."""
        parts = []
        for (window, ph), c in sorted(self.counts.items()):
            li, ei = np.nonzero(c)
            parts.append(
                (np.full(len(li), window * self.window_ns, np.int64), self.moe_layer_ids[li],
                 ei.astype(np.int32), np.full(len(li), ph, np.int32), c[li, ei])
            )
        self.counts = {}
        if not parts:
            return ROLLUP_SCHEMA.empty_table()
        ws, lids, eids, phs, cnt = (np.concatenate(x) for x in zip(*parts, strict=True))
        return pa.Table.from_arrays(
            [
                pa.array([run_id] * len(ws), pa.string()),
                pa.array(ws, pa.timestamp("ns")),
                pa.array(lids, pa.int16()),
                pa.array(eids, pa.int32()),
                pa.array(np.asarray(PHASES, dtype=object)[phs], pa.string()),
                pa.array(cnt, pa.int64()),
            ],
            schema=ROLLUP_SCHEMA,
        )
