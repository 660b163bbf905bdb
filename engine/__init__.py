"""r3trace.engine: the compact DeepSeek-V2/V3 inference engine that hosts route capture."""

from r3trace.engine.engine import Engine
from r3trace.engine.request import InvalidRequestError, SamplingParams

__all__ = ["Engine", "InvalidRequestError", "SamplingParams"]
