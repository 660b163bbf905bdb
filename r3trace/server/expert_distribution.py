"""SGLang's expert-distribution recorder endpoints over the engine's trace: /start_expert_distribution_record,
/stop_expert_distribution_record, /dump_expert_distribution_record (GET or POST, plain-text answers, as SGLang's
python/sglang/srt/entrypoints/http_server.py), so scripts written against SGLang run unchanged.

Start records a trace into `<trace_root>/.expert-distribution/`; dump writes it as SGLang's dump files
(r3trace/analysis/export_dump.py: `--expert-distribution-recorder-mode` stat or per_pass) into
`--expert-distribution-recorder-dir` (SGLang's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, default /tmp), then
deletes the recording and, if it was still recording, starts a fresh one (SGLang's dump resets and records on); a dump
that fails (a folder it cannot write) keeps the recording, stopped, for the next dump.
A recording an earlier server left undumped (killed while recording) is moved
aside at start-up, not deleted: `<trace_root>/expert-distribution-left-<ns>/`, a store `r3trace export` reads.
The engine records one trace at a time: start is refused (409) while a /start_trace run records, and
/start_trace while this one does. A dump of nothing is refused (409) where SGLang writes zeros.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from .errors import ERROR_RESPONSES, ApiError
from .service import GenerateService

if TYPE_CHECKING:
    from r3trace.analysis.export_dump import Mode

log = logging.getLogger("r3trace.server")
FOLDER = ".expert-distribution"  # below --trace-root: the recorder's own trace, deleted by each dump
PREFIX = "expert-distribution-"  # its run ids


class Recorder:
    """The recorder's state: the folder it records into and whether its run is the engine's trace."""

    def __init__(self, engine: Any, service: GenerateService, trace_root: Path, out_dir: Path, mode: Mode) -> None:
        self.engine, self.service = engine, service
        self.folder = trace_root / FOLDER
        self.out_dir, self.mode = out_dir, mode
        self.run_id: str | None = None  # the run recorded since the last start or dump
        self._lock = asyncio.Lock()  # one start, stop or dump at a time
        if any(self.folder.glob("run_id=*")):  # a recording an earlier server left undumped (a crash, a kill)
            kept = trace_root / f"expert-distribution-left-{time.time_ns()}"
            self.folder.rename(kept)
            log.warning("expert distribution: an earlier server's recording is kept in %s (r3trace export %s --out "
                        "DIR writes its dumps)", kept, kept)

    def _recording(self, st: dict[str, Any] | None = None) -> bool:
        """Whether the engine's trace (its status st, read when not given) is this recorder's run."""
        st = self.engine.trace_status() if st is None else st
        return bool(st.get("tracing")) and self.run_id is not None and st.get("run_id") == self.run_id

    async def start(self) -> None:
        cfg = getattr(self.engine, "config", None)
        if self.mode == "per_pass" and cfg is not None and cfg.has_placement and not cfg.capture_physical_ids:
            raise ApiError(400, "start_expert_distribution_record: --expert-distribution-recorder-mode per_pass counts "
                                "slots, and this engine runs a placement without --capture-physical-ids")
        async with self._lock:
            st = self.engine.trace_status()
            mine = self._recording(st)
            if st.get("tracing") and not mine:
                raise ApiError(409, f"start_expert_distribution_record: run {st.get('run_id')} is being traced "
                                    "(the recorder records through the engine's one trace); POST /stop_trace first")
            if mine:  # SGLang: start while recording warns and starts over
                log.warning("expert distribution: already recording; starting over")
                await self.service.call(self.engine.stop_trace)
            await self._begin()

    async def stop(self) -> None:
        async with self._lock:
            if not self._recording():
                log.warning("expert distribution: not recording; POST /start_expert_distribution_record first")
                return
            await self.service.call(self.engine.stop_trace)

    async def dump(self) -> list[Path]:
        async with self._lock:
            recording = self._recording()
            if recording:
                await self.service.call(self.engine.stop_trace)
            if self.run_id is None:
                raise ApiError(409, "dump_expert_distribution_record: nothing recorded; POST "
                                    "/start_expert_distribution_record first")
            paths = await self.service.call(self._write, self.run_id)  # a failure keeps the recording for a retry
            shutil.rmtree(self.folder, ignore_errors=True)
            self.run_id = None
            if recording:
                await self._begin()
            log.info("expert distribution: wrote %s", ", ".join(map(str, paths)))
            return paths

    async def _begin(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)  # a recording no dump took (a stop, then a start)
        try:
            self.folder.mkdir(parents=True)
        except OSError as e:
            raise ApiError(500, f"start_expert_distribution_record: cannot make {self.folder} ({e.strerror or e}); "
                                "check --trace-root") from e
        from r3trace.trace.schema import TraceStateError

        run_id = f"{PREFIX}{time.time_ns()}"
        try:
            await self.service.call(self.engine.start_trace, str(self.folder), run_id=run_id)
        except TraceStateError as e:  # a /start_trace that won the race
            raise ApiError(409, f"start_expert_distribution_record: {e}") from e
        self.run_id = run_id

    def _write(self, run_id: str) -> list[Path]:
        from r3trace.analysis.export_dump import export_expert_distribution
        from r3trace.analysis.store import TraceStore
        from r3trace.trace.schema import TraceSchemaError

        try:
            return export_expert_distribution(TraceStore(self.folder), run_id, self.out_dir, self.mode)
        except TraceSchemaError as e:  # no rows yet
            raise ApiError(409, f"dump_expert_distribution_record: {e}") from e
        except OSError as e:
            raise ApiError(500, f"dump_expert_distribution_record: cannot write {self.out_dir} ({e.strerror or e}); "
                                "check --expert-distribution-recorder-dir; the recording is kept for the next "
                                "dump") from e


def build_recorder_router(recorder: Recorder) -> APIRouter:
    """The three endpoints, each on GET and POST (one OpenAPI operation id a method)."""
    router = APIRouter(responses=ERROR_RESPONSES)
    answers = {"start": ("Start recording the expert distribution.\n", recorder.start),
               "stop": ("Stop recording the expert distribution.\n", recorder.stop),
               "dump": ("Dump expert distribution record.\n", recorder.dump)}
    for name, (text, act) in answers.items():
        for method in ("GET", "POST"):
            router.add_api_route(f"/{name}_expert_distribution_record", _answer(act, text), methods=[method],
                                 response_class=PlainTextResponse, operation_id=f"{name}_expert_distribution_{method}")
    return router


def _answer(act: Callable[[], Awaitable[Any]], text: str) -> Callable[[], Awaitable[str]]:
    async def endpoint() -> str:
        await act()
        return text

    return endpoint
