"""ServerConfig: every server option, frozen and checked once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # 8 MiB: a 32k-token prompt as JSON ids is ~200 KB


class ServerConfigError(ValueError):
    """A server option is out of range; the message names the option, the value and the limit."""


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = "r3trace"
    host: str = "127.0.0.1"  # loopback unless told otherwise: the API has no authentication
    port: int = 30000  # SGLang's default port, so existing clients need no change
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_concurrency: int = 256  # worker threads waiting on the engine at once
    trace_root: Path = Path("traces")  # /start_trace writes only below this folder
    placement_root: Path = Path(".")  # /update_expert_placement reads only below this folder
    chat_template: str | None = None  # jinja source; None: the fallback "role: content" template
    # other names a request's `model` may carry: `r3trace serve` adds the model's path as given, resolved,
    # and its folder name; any other name is a 404 model_not_found
    model_aliases: tuple[str, ...] = ()
    # SGLang's --enable-cache-report: OpenAI usage carries prompt_tokens_details.cached_tokens when any token hit
    enable_cache_report: bool = False
    # SGLang's expert-distribution recorder endpoints (expert_distribution.py): what a dump writes, and where
    expert_distribution_mode: Literal["stat", "per_pass"] = "stat"
    expert_distribution_dir: Path = Path("/tmp")  # SGLang's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR default

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ServerConfigError(f"port={self.port} must be in 0..65535")
        if self.max_body_bytes < 1024:
            raise ServerConfigError(f"max_body_bytes={self.max_body_bytes} must be >= 1024")
        if self.max_concurrency < 1:
            raise ServerConfigError(f"max_concurrency={self.max_concurrency} must be >= 1")
        if self.expert_distribution_mode not in ("stat", "per_pass"):
            raise ServerConfigError(f"expert_distribution_mode={self.expert_distribution_mode!r} must be stat or "
                                    "per_pass (per_token records hold input_ids, which a trace does not keep)")

    @property
    def model_names(self) -> frozenset[str]:
        """Every name the OpenAI endpoints accept in `model`: the served name and its aliases."""
        return frozenset((self.model_name, *self.model_aliases))
