"""The one check of an expert placement map's rows (phy2log [L, P]: the logical expert of each physical slot), for
every reader of one: the trace's placements table (trace/placements.py), `eplb --previous`'s SGLang file
(eplb/previous.py), an SGLang dump's map (analysis/ingest_dump.py), Placement (eplb/placement.py) and the engine's
ExpertLocation (engine/layers/expert_location.py); each caller prefixes the field and the layer and raises its own
error. numpy only: r3trace.eplb (imported inside vLLM and SGLang by their plugins) stays free of pyarrow."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def phy2log_fault(row: Any, num_experts: int) -> str | None:
    """The first fault of one layer's phy2log row [P] of integers over E = num_experts logical experts: the lowest slot
    holding an id outside 0..E-1, else the lowest expert no slot holds; None when every slot holds an expert and every
    expert a slot."""
    row = np.asarray(row)
    bad = np.flatnonzero((row < 0) | (row >= num_experts))
    if bad.size:
        return f"slot {int(bad[0])} holds expert {int(row[bad[0]])}, outside 0..{num_experts - 1}"
    missing = np.flatnonzero(np.bincount(row, minlength=num_experts) == 0)  # [E] slots per expert (ids checked above)
    if missing.size:
        return f"expert {int(missing[0])} of 0..{num_experts - 1} has no slot"
    return None


def rows_fault(table: Any, layer_ids: Sequence[int], num_experts: int) -> tuple[int, int, str] | None:
    """The first faulty row of a map [n, P] over the MoE layers layer_ids: (its index, its layer id, phy2log_fault's
    text); None when every row is a placement."""
    for i, (row, layer) in enumerate(zip(np.asarray(table), layer_ids, strict=True)):
        fault = phy2log_fault(row, num_experts)
        if fault is not None:
            return i, int(layer), fault
    return None
