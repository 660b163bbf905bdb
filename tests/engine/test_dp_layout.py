"""DpLayout's rows, the idle batch, capture through an explicit row range, and EP's shared-experts option.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_dp_layout.py

One process, no process group: the layouts are pure host arithmetic, and the capturer's row range is exercised
with a batch whose rows sit in the middle of the routed batch (what DP rank 1 sees under DP attention). The
multi-process paths are tests/engine/test_dp_attention.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3trace.capture.capturer import CaptureConfig, CaptureConfigError, RoutedExpertsCapturer
from r3trace.capture.recorder import RowRange
from r3trace.engine.communicator import ScatterMode, mlp_input_mode
from r3trace.engine.dp_layout import DpLayout, gather_dp_layout
from r3trace.engine.engine_config import EngineConfig, EngineConfigError
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.model import fuse_shared_experts
from r3trace.engine.parallel import ParallelInfo

M, K, E = 2, 3, 8


@pytest.mark.parametrize(
    ("mode", "starts", "buffer_len"),
    [("max", [0, 5, 10], 15), ("sum", [0, 3, 3], 8)],
)
def test_layout_rows(mode: str, starts: list[int], buffer_len: int) -> None:
    counts = (3, 0, 5)  # DP rank 1 idle
    for d in range(3):
        layout = DpLayout(counts, d, mode)  # type: ignore[arg-type]
        assert (layout.local_start, layout.local_count, layout.buffer_len) == (starts[d], counts[d], buffer_len)
        assert layout.route_rows == RowRange(starts[d], counts[d])
        local = DpLayout(counts, d, mode, moe_batch="local")  # type: ignore[arg-type]
        assert local.route_rows == RowRange(0, counts[d])  # EP: the router sees only this DP rank's rows


def test_layout_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="dp_rank=2"):
        DpLayout((1, 2), 2, "max")
    with pytest.raises(ValueError, match="mode='pad'"):
        DpLayout((1, 2), 0, "pad")  # type: ignore[arg-type]


def test_gather_in_one_process_and_modes() -> None:
    layout = gather_dp_layout(7, ParallelInfo(), "sum", replay=True)
    assert (layout.counts, layout.mode, layout.any_replay, layout.buffer_len) == ((7,), "sum", True, 7)
    assert mlp_input_mode(ParallelInfo(0, 2, 2, 1), is_moe=True) is ScatterMode.FULL
    assert mlp_input_mode(ParallelInfo(0, 2, 2, 2), is_moe=True) is ScatterMode.SCATTERED
    assert mlp_input_mode(ParallelInfo(0, 2, 2, 2), is_moe=False) is ScatterMode.FULL
    assert mlp_input_mode(ParallelInfo(0, 2, 1, 2), is_moe=False) is ScatterMode.TP_ATTN_FULL


def test_idle_batch() -> None:
    fb = ForwardBatch.idle(forward_id=3, req_to_token=torch.zeros(1, 4, dtype=torch.int32), device="cpu",
                           dp_layout=DpLayout((0, 4), 0, "max"), dp_rank=0)  # fmt: skip
    assert fb.num_tokens == 0 and fb.batch_size == 0 and fb.route_rows == RowRange(0, 0)


def test_shared_experts_under_ep() -> None:
    ep2 = ParallelInfo(0, 2, 1, 2)
    assert fuse_shared_experts(EngineConfig(moe_backend="triton"), ep2) is False  # auto: separate under EP
    assert fuse_shared_experts(EngineConfig(moe_backend="triton"), ParallelInfo()) is True
    with pytest.raises(EngineConfigError, match="^shared_experts='fused' needs ep_size=1"):
        fuse_shared_experts(EngineConfig(shared_experts="fused"), ep2)


def _config(**kw: int) -> CaptureConfig:
    base = dict(num_hidden_layers=3, moe_layer_ids=(1, 2), top_k=K, num_experts=E, kv_slots=64, max_batch_tokens=32,
                chunked_prefill_size=16, max_running_requests=4)  # fmt: skip
    return CaptureConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_capture_config_pads_to_attention_tp() -> None:
    assert _config(attn_tp_size=3).required_rows == 18  # 16 rows padded to a multiple of 3
    with pytest.raises(CaptureConfigError, match="attn_tp_size 3"):
        _config(max_batch_tokens=17, attn_tp_size=3)


@pytest.mark.parametrize("copy_all", [True, False])
def test_capturer_reads_the_batch_rows(copy_all: bool) -> None:
    """The routed batch holds 11 rows; this rank's 5 are rows [4, 9) (route_rows): the capturer returns
    exactly those, for the requests that asked, and never rows [0, 5)."""
    capturer = RoutedExpertsCapturer(_config())
    capturer.add_request("a", want=True)
    capturer.add_request("b", want=copy_all)
    fb = ForwardBatch.build(
        forward_id=0, input_ids=[5] * 5, prefix_lens=[0, 0], extend_lens=[3, 2], req_pool_indices=[0, 1],
        out_cache_loc=np.array([10, 11, 12, 20, 21]), req_to_token=torch.zeros(2, 8, dtype=torch.int32),
        logits_rows=[], device="cpu", request_ids=["a", "b"], phases=["prefill", "prefill"],
    )  # fmt: skip
    fb.dp_layout = DpLayout((4, 5, 2), 1, "sum")
    gen = torch.Generator().manual_seed(0)
    routed = {lid: torch.randint(0, E, (11, K), generator=gen, dtype=torch.int32) for lid in (1, 2)}  # [N, K]
    capturer.on_forward_begin(fb)
    for lid, ids in routed.items():
        capturer.capture(lid, ids)
    capturer.on_forward_end(fb)
    mine = torch.stack([routed[1][4:9], routed[2][4:9]], dim=1).numpy()  # [5, M, K]
    a = capturer.rows("a", np.array([10, 11, 12]), 0, 3).ids[:, [1, 2]]
    assert np.array_equal(a, mine[:3])
    b = capturer.rows("b", np.array([20, 21]), 0, 2).ids[:, [1, 2]]
    assert np.array_equal(b, mine[3:]) if copy_all else (b == -1).all()  # never copied: -1, not a neighbour's
