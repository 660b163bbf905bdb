"""Route capture: the recorder protocol, the capturer with its device/host buffers, and the wire format."""

from .capturer import RoutedExpertsCapturer
from .config import CaptureConfig, CaptureConfigError
from .recorder import ListRecorder, NullRecorder, RouteRecorder
from .route_rows import RouteRows

__all__ = [
    "CaptureConfig", "CaptureConfigError", "ListRecorder", "NullRecorder", "RouteRecorder", "RouteRows",
    "RoutedExpertsCapturer", "WireFormatError", "decode_routed_experts", "decode_routed_weights",
    "encode_float16", "encode_int32",
]


def __getattr__(name: str) -> object:
    # The wire format needs pybase64; the engine imports this package for the recorder protocol and
    # must load where pybase64 is absent (a bare GPU image), so the codec is imported on first use.
    if name in ("WireFormatError", "decode_routed_experts", "decode_routed_weights", "encode_float16", "encode_int32"):
        from . import wire

        return getattr(wire, name)
    raise AttributeError(f"module 'r3trace.capture' has no attribute {name!r}")
