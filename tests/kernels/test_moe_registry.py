"""The fused MoE's registry (kernels/moe/registry.py): the plan the engine resolves once runs, for every T, the path
and tiles fused_moe picks per call (moe_config), and its output is fused_moe's, bit for bit.

Run: TRITON_INTERPRET=1 .venv/bin/pytest tests/kernels/test_moe_registry.py -q   (CPU)
"""

from __future__ import annotations

import pytest
import torch

from r3trace.engine.layers.moe import make_experts_fn
from r3trace.engine.model_config import ModelConfig
from r3trace.kernels.contract import KernelInputError
from r3trace.kernels.moe.config import GEMV_T1, GEMV_T4, GEMV_WIDE, moe_config
from r3trace.kernels.moe.fused_moe import fused_moe, fused_moe_ref
from r3trace.kernels.moe.registry import MoePlan, MoeShape, resolve_moe
from tests.kernels.conftest import DEVICE, assert_close_to_ref, requires_triton
from tests.kernels.moe_cases import moe_case


@pytest.mark.parametrize("inter", [0, 24, 256, 257, 2048])
@pytest.mark.parametrize("hidden", [40, 2048, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_plan_picks_what_moe_config_picks(inter: int, hidden: int, dtype: torch.dtype) -> None:
    """Every T from 0 to 20 and a few large ones, E from 8 to 256 rows, K 6 and 8: the same MoeConfig."""
    plan = resolve_moe(MoeShape(hidden, inter), dtype)
    for experts in (8, 66, 256):
        for k in (6, 8):
            for t in [*range(21), 64, 1024, 4096]:
                want = moe_config(t * k, experts, dtype.itemsize, inter, tokens=t, hidden=hidden)
                assert plan.config(t, t * k, experts) == want, (t, k, experts)


def test_plan_holds_the_threshold_and_tiles() -> None:
    """I <= 256: gemv up to T = 4 (GEMV_T1 at 1-2, GEMV_T4 at 3-4); I > 256: T = 1 only (GEMV_WIDE); I = 0 (unknown):
    never. The values are config.py's measured table (kernels/moe/__init__.py)."""
    small = resolve_moe(MoeShape(7168, 256), torch.bfloat16)
    assert (small.gemv_max_tokens, small.gemv_tiles) == (4, (GEMV_T1, GEMV_T1, GEMV_T4, GEMV_T4))
    wide = resolve_moe(MoeShape(7168, 2048), torch.bfloat16)
    assert (wide.gemv_max_tokens, wide.gemv_tiles) == (1, (GEMV_WIDE,))
    none = resolve_moe(MoeShape(7168, 0), torch.bfloat16)
    assert (none.gemv, none.gemv_max_tokens, none.gemv_tiles) == (None, 0, ())
    assert small.config(5, 40, 256).gemv is None and small.config(4, 32, 256).gemv is GEMV_T4


def test_resolve_refuses_what_no_path_runs() -> None:
    with pytest.raises(KernelInputError, match=r"^the fused MoE takes .* not torch.int32$"):
        resolve_moe(MoeShape(64, 32), torch.int32)


def test_engine_builds_one_plan_for_its_shape() -> None:
    """make_experts_fn('triton') is the plan for the model's D and I (built once by the model for every layer)."""
    cfg = ModelConfig.from_hf("samples/model")
    plan = make_experts_fn("triton", cfg, torch.bfloat16)
    assert isinstance(plan, MoePlan)
    assert plan.shape == MoeShape(cfg.hidden_size, cfg.moe_intermediate_size) and plan.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="needs the model config"):
        make_experts_fn("triton")


@requires_triton
@pytest.mark.parametrize("T", [1, 3, 4, 5, 13])
def test_plan_output_is_fused_moes(T: int, poisoned_empty: None) -> None:
    """I = 24 (<= 256): T <= 4 through the gemv path, above through the grouped one; both bitwise fused_moe's default
    and close to the per-expert reference."""
    dtype = torch.bfloat16
    hidden, w13, w2, ids, weights = moe_case(T, 40, 6, 24, 3, dtype, DEVICE, seed=T)
    plan = resolve_moe(MoeShape(40, 24), dtype)
    assert (plan.config(T, ids.numel(), 6).gemv is not None) == (T <= 4)
    out = plan(hidden, w13, w2, ids, weights)
    assert torch.equal(out, fused_moe(hidden, w13, w2, ids, weights))
    assert_close_to_ref(out, fused_moe_ref(hidden.float(), w13.float(), w2.float(), ids, weights), dtype)
