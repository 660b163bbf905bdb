"""The engine stop tests reuse the engine fixtures: one tiny V3 checkpoint per session."""

from tests.engine.conftest import tiny_ckpt  # noqa: F401 (pytest fixture)
