"""Capture tests reuse the engine fixtures: one tiny V3 checkpoint per session, an Engine factory."""

from tests.engine.conftest import make_engine, tiny_ckpt  # noqa: F401 (pytest fixtures)
