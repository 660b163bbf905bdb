"""Route capture: the recorder protocol, the capturer with its device/host buffers, and the wire format."""

from .capturer import CaptureConfig, CaptureConfigError, RoutedExpertsCapturer, RouteRows
from .recorder import ListRecorder, NullRecorder, RouteRecorder
from .wire import WireFormatError, decode_routed_experts, decode_routed_weights, encode_float16, encode_int32

__all__ = [
    "CaptureConfig", "CaptureConfigError", "ListRecorder", "NullRecorder", "RouteRecorder", "RouteRows",
    "RoutedExpertsCapturer", "WireFormatError", "decode_routed_experts", "decode_routed_weights",
    "encode_float16", "encode_int32",
]
