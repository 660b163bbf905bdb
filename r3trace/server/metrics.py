"""ServerMetrics: counters and gauges rendered in Prometheus' text exposition format (version 0.0.4).

Thread-safe: handlers update them from the event loop and from worker threads. Kept in-process (no
prometheus_client dependency) because the server exposes a dozen series.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class ServerMetrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.capture_bytes = 0  # decoded bytes of route payloads returned (int32 ids)
        self.capture_rows = 0
        self.in_flight = 0  # accepted by the server, not finished: the queue in front of the engine

    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def add_tokens(self, prompt: int, completion: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def add_capture(self, payload_b64: str, rows: int) -> None:
        """payload: base64 text; 4 characters carry 3 bytes (padding subtracted)."""
        raw = len(payload_b64) * 3 // 4 - payload_b64[-2:].count("=")
        with self._lock:
            self.capture_bytes += raw
            self.capture_rows += rows

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def render(self, trace: dict[str, Any] | None = None) -> str:
        """trace: the engine's trace_status() (None: the engine records no traces; no trace series then)."""
        m = f'model="{self.model}"'
        with self._lock:
            lines = [
                "# HELP r3trace_requests_total HTTP requests answered, by endpoint and status code.",
                "# TYPE r3trace_requests_total counter",
            ]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'r3trace_requests_total{{{m},endpoint="{endpoint}",status="{status}"}} {n}')
            series: list[tuple[str, str, str, float]] = [
                ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens),
                ("completion_tokens_total", "counter", "Generated tokens of finished requests.",
                 self.completion_tokens),
                ("capture_bytes_total", "counter", "Bytes of routed-expert ids returned (decoded int32).",
                 self.capture_bytes),
                ("capture_rows_total", "counter", "Token rows of routes returned.", self.capture_rows),
                ("queue_depth", "gauge", "Requests accepted and not finished (waiting or running).",
                 self.in_flight),
            ]
        if trace is not None:
            on = bool(trace.get("tracing"))
            series += [
                ("trace_recording", "gauge", "1 while a trace records.", int(on)),
                ("trace_rows_buffered", "gauge", "Route rows captured and not yet committed to a listed file.",
                 trace.get("rows_buffered", 0) if on else 0),
                ("trace_rows_durable", "gauge", "Route rows of the recording run in committed files.",
                 trace.get("rows_durable", 0) if on else 0),
                ("trace_requests_durable", "gauge", "Finished requests of the recording run committed.",
                 trace.get("requests_durable", 0) if on else 0),
                ("trace_last_flush_age_seconds", "gauge", "Seconds since the recording run's last commit.",
                 round(float(trace.get("last_flush_age_s", 0.0)), 3) if on else 0),
                ("trace_stalled_seconds_total", "counter",
                 "Seconds callers waited for a starved trace flusher (back-pressure) in the recording run.",
                 round(float(trace.get("stalled_s", 0.0)), 3) if on else 0),
                ("trace_commit_failing", "gauge", "1 while the last commit attempt failed (rows kept, retried).",
                 int(on and trace.get("last_error") is not None)),
            ]
        for name, kind, help_text, value in series:
            lines += [f"# HELP r3trace_{name} {help_text}", f"# TYPE r3trace_{name} {kind}",
                      f"r3trace_{name}{{{m}}} {value}"]
        return "\n".join(lines) + "\n"
