"""Suite-wide guard: a test fails when an engine step raised during it (no test makes one fail on purpose).

Why: the event loop catches a step's exception, logs it and finishes every request in flight with an abort and no
tokens (engine/event_loop.py, _guarded), so two engines that both fail agree on their (empty) outputs, and a test
that only compares them passes. Seen: Triton 3.6's interpreter under numpy 2.4 raised in every kernel, and
tests/engine/test_backends.py's fused-shared-experts test passed in 0.2 s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

# bench/__init__.py moves the repository root last on sys.path where `python -m pytest` put it first: there kernels/
# shadowed Hugging Face's top-level `kernels`, which transformers imports with its models
import bench  # noqa: F401

STEP_LOGGER = "r3trace.engine.event_loop"


class _Failures(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def no_failed_engine_steps() -> Iterator[None]:
    handler = _Failures()
    logger = logging.getLogger(STEP_LOGGER)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if handler.records:
        first = handler.records[0]
        detail = repr(first.exc_info[1]) if first.exc_info else first.getMessage()
        pytest.fail(f"{len(handler.records)} engine step(s) failed during the test; the first: {detail}")
