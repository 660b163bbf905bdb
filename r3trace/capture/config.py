"""CaptureConfig: the capturer's sizing, checked once so that no forward can overflow its buffers.

One forward carries at most dp_size x max(chunked_prefill_size, max_running_requests x (1 + spec_verify_tokens))
tokens (DP attention gathers every rank's batch; speculative verify adds draft tokens per request): SGLang
sized its buffer without the DP and verify terms and overflowed (#26860, #31116). A chained speculative launch of
S verifies (EngineConfig.speculative_launch_steps) keeps each one's rows until the host reads them all: S times the
verify term. Under expert parallelism with
attention TP A > 1 a DP rank's rows are padded to a multiple of A before the top-k ids come back: the per-rank
term is rounded up to it.
"""

from __future__ import annotations

from dataclasses import dataclass


class CaptureConfigError(ValueError):
    """A capture setting could overflow or is out of range; the message gives the numbers."""


@dataclass(frozen=True)
class CaptureConfig:
    num_hidden_layers: int
    moe_layer_ids: tuple[int, ...]
    top_k: int
    num_experts: int
    kv_slots: int  # host rows: one per KV slot of the pool
    max_batch_tokens: int  # device rows: the most tokens one forward may carry
    chunked_prefill_size: int  # the scheduler's per-forward token budget
    max_running_requests: int
    dp_size: int = 1  # DP attention: the capturer sees the DP-gathered batch
    attn_tp_size: int = 1  # expert parallelism: a rank's rows padded to a multiple of it
    spec_verify_tokens: int = 0  # draft tokens verified per request per forward (speculation)
    verify_launch_steps: int = 1  # verify forwards of one chained launch whose rows the buffer holds at once
    device: str = "cpu"
    with_weights: bool = False
    physical_slots: int = 0  # P: keep the physical slot of each pair too (capture_physical_ids); 0: not kept

    def __post_init__(self) -> None:
        need = self.required_rows
        if self.max_batch_tokens < need:
            raise CaptureConfigError(
                f"max_batch_tokens={self.max_batch_tokens} could overflow: one forward may carry up to {need} tokens "
                f"= dp_size {self.dp_size} x max(chunked_prefill_size {self.chunked_prefill_size}, "
                f"max_running_requests {self.max_running_requests} x (1 + spec_verify_tokens "
                f"{self.spec_verify_tokens}) x verify_launch_steps {self.verify_launch_steps}) rounded up to "
                f"attn_tp_size {self.attn_tp_size}"
            )
        if not self.moe_layer_ids or max(self.moe_layer_ids) >= self.num_hidden_layers:
            raise CaptureConfigError(f"moe_layer_ids={self.moe_layer_ids} outside 0..{self.num_hidden_layers - 1}")

    @property
    def required_rows(self) -> int:
        verify = self.max_running_requests * (1 + self.spec_verify_tokens) * self.verify_launch_steps
        per_rank = max(self.chunked_prefill_size, verify)
        return self.dp_size * -(-per_rank // self.attn_tp_size) * self.attn_tp_size
