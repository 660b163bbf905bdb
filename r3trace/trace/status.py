"""What a recording run reports about itself: `TraceWriter.status()`, read by /metrics and the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WriterStatus:
    """What /metrics and `Engine.trace_status()` report about a recording run."""

    run_id: str
    run_dir: str
    rows_buffered: int  # captured, not yet in a committed file
    rows_durable: int  # in files the manifest lists
    requests_durable: int
    last_flush_age_s: float  # since the last commit (or since the run started)
    commits: int
    compactions: int
    files: int
    last_error: str | None
    stalled_s: float = 0.0  # callers' time held back while the flusher was starved (pending.Inbox)
