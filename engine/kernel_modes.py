"""KernelModes: which kernels and MLA path an EngineConfig's numerics modes select, and the checks that refuse a mode
on kernels that cannot keep its promise. EngineConfig (engine_config.py) inherits it; the fields it reads are
EngineConfig's, declared here for the type checker.

Modes, strongest first: exact (`deterministic`, the ref backends, bitwise equal across layouts and batches),
batch-invariant (`batch_invariant`, the triton kernels with fixed tiles: a row's bits never depend on its batch),
row-invariant (`row_invariant`, the CUDA default: decode and verify rows absorbed with fixed splits, prompt rows on the
MHA path over every key, so a row's bits follow its own tokens), off (the fastest kernels for each shape).
"""

from __future__ import annotations

from typing import Literal

from .layers.matmul import MatmulImpl

MlaImpl = Literal["auto", "normal", "absorb", "split"]  # split: row-invariant mode's path by row (layers/mla.py)

# the five math backend fields (each "ref" or "triton")
BACKENDS = ("attention_backend", "moe_backend", "topk_backend", "norm_backend", "rope_backend")


class EngineConfigError(ValueError):
    """An engine option is out of range; the message names the option, the value and the limit."""


class KernelModes:
    device: str
    mla_path: Literal["auto", "normal", "absorb"]
    attention_backend: str
    moe_backend: str
    topk_backend: str
    norm_backend: str
    rope_backend: str
    deterministic: bool
    batch_invariant: bool
    row_invariant: bool | None
    deepep_mode: Literal["auto", "normal", "low_latency"]

    def _need_backends(self, want: str, why: str) -> None:
        """Every BACKENDS field is `want`, else an error naming the first that is not, its value and `why`."""
        for name in BACKENDS:
            if getattr(self, name) != want:
                raise EngineConfigError(f"{name}={getattr(self, name)!r}: {why}")

    def _check_deterministic(self) -> None:
        if self.deepep_mode == "normal":
            raise EngineConfigError(
                "deepep_mode='normal': deterministic=True needs low_latency (normal mode sums per-rank partials)"
            )
        self._need_backends("ref", "deterministic=True needs the ref backend")

    def _check_batch_invariant(self) -> None:
        if self.deterministic:
            raise EngineConfigError(
                "batch_invariant=True with deterministic=True: pick one (exact mode is batch-invariant already, on the "
                "ref backends; batch_invariant is the triton path's)"
            )
        self._need_backends("triton", "batch_invariant=True needs the triton backend (the ref ops are torch's, whose "
                            "reduction order follows the shapes)")
        if self.mla_path == "normal":
            raise EngineConfigError(
                "mla_path='normal': batch_invariant=True runs every row on the absorbed path (the decode kernel's "
                "one reduction order; the normal path's prefill kernel is another)"
            )

    def _check_row_invariant(self) -> None:
        if self.deterministic or self.batch_invariant:
            raise EngineConfigError(
                "row_invariant=True with deterministic or batch_invariant: both make every row invariant already"
            )
        self._need_backends("triton", "row_invariant=True needs the triton backend")
        if self.mla_path != "auto":
            raise EngineConfigError(f"mla_path={self.mla_path!r}: row_invariant=True picks the path by row (auto)")

    @property
    def row_invariant_on(self) -> bool:
        """row_invariant resolved (None: on with the five triton backends on CUDA, mla_path auto, neither exact nor
        batch-invariant mode). Over several processes the auto case runs the same kernels without the claim (the
        collectives reduce in NCCL's order); check_graph_layout refuses an explicit True there."""
        if self.row_invariant is not None:
            return self.row_invariant
        triton = all(getattr(self, name) == "triton" for name in BACKENDS)
        return (triton and self.device.startswith("cuda") and self.mla_path == "auto" and not self.deterministic
                and not self.batch_invariant)  # fmt: skip

    # The implementations the model is built with: the configured backend, "exact" in exact mode, "invariant" in
    # batch-invariant mode (the triton kernels with fixed tiles); row-invariant mode takes batch_invariant's GEMM, MoE
    # plan and router logits, and "row_invariant" attention (fixed splits for the absorbed rows, MHA for the prompts').
    @property
    def attention_impl(self) -> str:
        return {"exact": "exact", "all": "invariant", "row": "row_invariant"}.get(self._invariance,
                                                                                self.attention_backend)

    @property
    def moe_impl(self) -> str:
        return {"exact": "exact", "all": "invariant", "row": "invariant"}.get(self._invariance, self.moe_backend)

    @property
    def topk_impl(self) -> str:
        return {"exact": "exact", "all": "invariant", "row": "invariant"}.get(self._invariance, self.topk_backend)

    @property
    def matmul_impl(self) -> MatmulImpl:
        """Every linear's and absorbed per-head product's implementation (layers/matmul.py)."""
        return {"exact": "exact", "all": "invariant", "row": "invariant"}.get(  # type: ignore[return-value]
            self._invariance, "torch")

    @property
    def _invariance(self) -> Literal["exact", "all", "row", "off"]:
        if self.deterministic:
            return "exact"
        if self.batch_invariant:
            return "all"
        return "row" if self.row_invariant_on else "off"

    @property
    def norm_impl(self) -> str:
        return "exact" if self.deterministic else self.norm_backend

    @property
    def mla_impl(self) -> MlaImpl:
        """One MLA path for every forward in exact and batch-invariant mode (absorbed, unless exact mode is asked for
        normal), the path by row in row-invariant mode (split: decode and verify rows absorbed, prompt rows normal),
        else mla_path."""
        if self._invariance == "row":
            return "split"
        one_path = self.deterministic or self.batch_invariant
        return "absorb" if one_path and self.mla_path == "auto" else self.mla_path
