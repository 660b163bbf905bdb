"""A request's routes as the capturer keeps and returns them.

RouteRows: rows [offset, offset + n) of one request, as the wire carries them ([n, L, K], -1 on dense layers).
RequestState: what the capturer holds for one request from registration to finish: the prefix it reused, the
rows saved when it was retracted, and how far the trace sink and the client stream have read.

Shape legend: n rows, L num_hidden_layers, M MoE layers, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RouteRows:
    """Rows [offset, offset + n) of one request. ids: [n, L, K] int32 with -1 on dense layers."""

    offset: int
    ids: np.ndarray
    weights: np.ndarray | None = None
    physical: np.ndarray | None = None  # [n, L, K] int32 physical slots (capture_physical_ids), -1 on dense layers


@dataclass
class RequestState:
    want: bool
    cached_len: int = 0
    first_cached_len: int = -1  # prefix-cache hit at first admission: those rows are source=prefix_cache
    prefix_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    kept: np.ndarray | None = None  # [n_kept, M, K] rows saved at retraction
    kept_weights: np.ndarray | None = None
    kept_physical: np.ndarray | None = None
    sink_emitted: int = 0  # positions already written to the sink
    stream_emitted: int = 0  # positions already streamed to the client
    verify_from: int = 1 << 62  # first position a verify forward computed (speculative decoding); none yet: huge

    @property
    def n_kept(self) -> int:
        return 0 if self.kept is None else len(self.kept)

    def keep(self, ids: np.ndarray, weights: np.ndarray | None, physical: np.ndarray | None) -> None:
        """At retraction: append the [n, M, K] rows of positions n_kept.. (weights / physical: None when the
        capturer does not hold them)."""
        self.kept = _append(self.kept, ids)
        if weights is not None:
            self.kept_weights = _append(self.kept_weights, weights)
        if physical is not None:
            self.kept_physical = _append(self.kept_physical, physical)

    def provenance(self, prompt_len: int, start: int, end: int) -> list[tuple[int, int, str, str]]:
        """Run-length provenance of rows [start, end): (first, last + 1, phase, source) segments.

        Rows kept across a retraction keep their first provenance, so this depends only on the first
        admission's prefix hit, the prompt length and the first position a verify forward computed (speculative
        decoding: every later row is a verify forward's)."""
        cached = max(self.first_cached_len, 0)
        verify = max(prompt_len, min(self.verify_from, end))
        bounds = [(0, cached, "prefill", "prefix_cache"), (cached, prompt_len, "prefill", "computed"),
                  (prompt_len, verify, "decode", "computed"), (verify, end, "verify", "computed")]
        return [(max(a, start), min(b, end), ph, src) for a, b, ph, src in bounds if min(b, end) > max(a, start)]


def join_rows(
    kept: np.ndarray | None, read: Callable[[np.ndarray], np.ndarray | None], slots: np.ndarray, start: int,
    end: int, empty: np.ndarray,
) -> np.ndarray:
    """Rows [start, end) [n, M, K]: those kept at retraction first, then read(slots) from the host buffer for
    the positions past them. empty: the [0, M, K] array returned when there are none."""
    n_kept = 0 if kept is None else len(kept)
    parts = []
    if start < n_kept:
        assert kept is not None
        parts.append(kept[start : min(end, n_kept)])
    if end > max(start, n_kept):
        fresh = read(slots[max(start, n_kept) : end])
        assert fresh is not None  # a reader that may return None is called only when the host keeps that array
        parts.append(fresh)
    return np.concatenate(parts) if parts else empty


def expand_layers(moe_rows: np.ndarray, fill: float, moe_layer_ids: Sequence[int], num_layers: int) -> np.ndarray:
    """[n, M, K] -> [n, L, K]: dense layers hold `fill` (-1 for ids, never 0)."""
    out = np.full((len(moe_rows), num_layers, moe_rows.shape[2]), fill, dtype=moe_rows.dtype)
    out[:, list(moe_layer_ids)] = moe_rows
    return out


def _append(old: np.ndarray | None, new: np.ndarray) -> np.ndarray:
    return new if old is None else np.concatenate([old, new])
