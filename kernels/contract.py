"""The launchers' input contract: one exception type, raised with the argument, the value and the limit.

Every launcher in `r3trace.kernels` checks shapes, strides and dtypes before it launches, because a Triton
kernel given a wrong stride reads the wrong memory silently instead of failing.
"""

from __future__ import annotations

import torch


class KernelInputError(ValueError):
    """A launcher argument has the wrong shape, stride, dtype or device; the message names it."""


def require(ok: bool, message: str) -> None:
    """Raise KernelInputError(message) unless ok (a bare assert would vanish under `python -O`)."""
    if not ok:
        raise KernelInputError(message)


def require_tensor(
    name: str,
    t: torch.Tensor,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    contiguous_last: bool = True,
) -> None:
    """Check rank, dtype, device and (by default) a unit stride on the last dimension. A last dimension of
    one element passes whatever its stride: only its index 0 is read, and torch calls such a tensor contiguous
    (a column of a [1, W] table converted with `.long()` keeps the stride W)."""
    require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    require(t.dtype in dtypes, f"{name} dtype {t.dtype} not in {dtypes}")
    require(t.device == device, f"{name} is on {t.device}, expected {device}")
    if contiguous_last and t.numel() > 0 and t.shape[-1] > 1:
        require(t.stride(-1) == 1, f"{name} must have stride 1 on its last dim, got strides {t.stride()}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def grid_len(lens: torch.Tensor, given: int | None) -> int:
    """Grid bound: given by the caller (host-side lengths, no sync) or read once from the device."""
    if given is not None:
        return given
    return int(lens.max().item()) if lens.numel() > 0 else 0
