"""The engine's MLA decode with the Gluon stage 1 (decode_kernel="auto" on Hopper) against the Triton kernel
(decode_kernel="triton"): bf16, 64 heads, kv_lora 128, rope 16, so the default picks Gluon. GPU (sm_90) only:
Gluon kernels do not run under TRITON_INTERPRET=1 (kernels/mla_decode_gluon.py).

Run: .venv/bin/python -m pytest -q -m gpu tests/engine/test_gluon_decode.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from r3trace.engine import Engine
from tests.tiny_models import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="the Gluon decode kernel is sm_90 only"),
]
TRITON = dict(attention_backend="triton", moe_backend="triton", topk_backend="triton", norm_backend="triton",
              rope_backend="triton", device="cuda", dtype="bfloat16", chunked_prefill_size=64)


def _uses_gluon(eng: Engine) -> bool:
    return all(layer.self_attn.backend._gluon for layer in eng.model.model.layers)


def test_gluon_decode_matches_triton_kernel(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "h64", "v3_noaux_groups", seed=7, num_attention_heads=64,
                           num_key_value_heads=64, kv_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=16,
                           v_head_dim=16, hidden_size=128, max_position_embeddings=1024)
    rng = np.random.default_rng(3)
    # lengths across one and several 64-key tiles, and one split boundary or more
    prompts = [rng.integers(2, 320, size=int(n)).tolist() for n in (5, 63, 64, 130, 300, 700)]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    out = {}
    for kernel in ("auto", "triton"):
        with Engine(ckpt, decode_kernel=kernel, **TRITON) as eng:
            assert _uses_gluon(eng) == (kernel == "auto")
            out[kernel] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                       top_logprobs_num=5)
    for g, t in zip(out["auto"], out["triton"], strict=True):
        # token 1 comes from the prefill (the same extend kernels in both): identical
        assert g["output_ids"][0] == t["output_ids"][0]
        # token 2 is the first decode step: the two kernels differ only in bf16 rounding of the attention
        # output (2^-8 relative) and fp32 summation order; through 3 layers that moves logprobs by ~1e-2.
        # 0.08 is 4-8x that and still far below a wrong-row or wrong-softmax error (logprobs off by > 1).
        lg = [e[0] for e in g["meta_info"]["output_top_logprobs"][1]]
        lt = [e[0] for e in t["meta_info"]["output_top_logprobs"][1]]
        np.testing.assert_allclose(lg, lt, atol=0.08)
