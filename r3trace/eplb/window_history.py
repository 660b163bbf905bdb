"""The load windows an inference server's EPLB handed ours, kept across its calls: vLLM and SGLang each hand one
window's summed loads a rearrangement and keep none, and ours' forecast and drift test need several
(vllm_policy.py, sglang_plugin.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3trace.eplb.dropin import as_array

KEEP_WINDOWS = 8  # the windows ours plans on, as the EPLB matrix's cells (bench/eplb_matrix.py, run_cell's history)


class WindowHistory:
    """The load windows [L, E] one process handed ours, oldest first, the newest KEEP_WINDOWS of each [L, E] shape
    (vLLM plans each model of an EplbState in turn: a draft model's layers are another shape).

    Every EP rank plans for itself (vLLM's EplbState.rearrange and SGLang's EPLBManager call the policy on each rank,
    then each moves weights by the old and new maps), so the ranks' plans must agree: they do while every rank has
    seen the same calls, which holds for both servers' lockstep rearrangements. An elastic resize (other slot, rank,
    node or group counts) brings new ranks with nothing kept, so every rank starts afresh there. An all-zero window is
    not kept: vLLM's profile run rearranges once on the empty load window before serving."""

    def __init__(self, keep: int = KEEP_WINDOWS) -> None:
        self.keep = keep
        self.windows: dict[tuple[int, ...], list[np.ndarray]] = {}
        self.sizes: dict[tuple[int, ...], tuple[int, ...]] = {}

    def clear(self) -> None:
        """Forgets every window, as a fresh process."""
        self.windows.clear()
        self.sizes.clear()

    def add(self, weight: Any, sizes: tuple[int, ...]) -> np.ndarray | None:
        """Keeps weight, planned for `sizes` (slots, ranks, nodes, groups); returns the windows kept since those
        sizes were first asked [W, L, E] (weight last), or None for an all-zero weight."""
        w = as_array(weight, np.float64)
        if not w.any():
            return None
        if self.sizes.get(w.shape) != sizes:
            self.windows[w.shape], self.sizes[w.shape] = [], sizes
        kept = self.windows[w.shape]
        kept.append(w)
        del kept[:-self.keep]
        return np.stack(kept)
