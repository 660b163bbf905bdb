"""End to end: the triton backends (attention, MoE, top-k, RMSNorm, RoPE) give the ref backends' greedy
tokens and routes.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_backends.py
On CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by `make test`); on a GPU
they compile. Chunked prefill (extend over a cached prefix), prefix-free prefill and decode all run,
so mha_prefill, mla_extend and mla_decode are each exercised.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

import r3trace
from tests.engine.conftest import EngineFactory, greedy, random_prompts

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton on CPU needs TRITON_INTERPRET=1", allow_module_level=True)


def _completed(out: dict[str, Any], n: int) -> None:
    """A request ran to its length: an engine whose step failed finishes every request with an abort and no tokens,
    which two failing engines would agree on."""
    assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]["finish_reason"]
    assert len(out["output_ids"]) == n


_BACKENDS = {
    "all": dict(attention_backend="triton", moe_backend="triton", topk_backend="triton", norm_backend="triton",
                rope_backend="triton"),
    "attention": dict(attention_backend="triton"),
    "moe+topk": dict(moe_backend="triton", topk_backend="triton"),
    "norm+rope": dict(norm_backend="triton", rope_backend="triton"),
}


# In the CPU suite: every backend at once at page size 1, and the attention backend (the one that reads pages) alone
# at page size 3; the rest is in the slow set (`make test-all`): the MoE and top-k kernels alone are the costliest
# (17 s at page 1, 29 s for all at page 3) and run in "all" and in tests/kernels
FAST = {(1, "all"), (1, "attention"), (1, "norm+rope"), (3, "attention")}


@pytest.mark.parametrize(("page_size", "backends"), [
    pytest.param(page, b, id=f"{page}-{name}", marks=[] if (page, name) in FAST else [pytest.mark.slow])
    for page in (1, 3) for name, b in _BACKENDS.items()])
def test_triton_backends_match_ref(make_engine: EngineFactory, backends: dict[str, str], page_size: int) -> None:
    prompts = random_prompts(3, 5, 17, seed=30)
    common = dict(chunked_prefill_size=8, page_size=page_size, kv_pool_tokens=240, device=DEVICE)
    ref = make_engine(**common).generate(input_ids=prompts, sampling_params=greedy(5), return_routed_experts=True)
    tri = make_engine(**common, **backends).generate(input_ids=prompts, sampling_params=greedy(5),
                                                     return_routed_experts=True)
    for a, b in zip(ref, tri, strict=True):
        _completed(a, 5)
        _completed(b, 5)
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_array_equal(r3trace.decode_routed_experts(a["meta_info"]),
                                      r3trace.decode_routed_experts(b["meta_info"]))


# triton with one shared expert (34 s in the interpreter) is in the slow set: n_shared = 2 runs the same kernels
# with a wider shared tail, ref with one keeps S = 1's layout, and test_replay_through_fused_shared_tail runs it
@pytest.mark.parametrize(("n_shared", "moe_backend"), [
    (1, "ref"), pytest.param(1, "triton", marks=pytest.mark.slow), (2, "ref"), (2, "triton")])
def test_fused_shared_experts_match_separate(
    tmp_path, moe_backend: str, n_shared: int  # type: ignore[no-untyped-def]
) -> None:
    """Shared experts as S extra experts of the routed MoE (EngineConfig.shared_experts="fused") against the MLP
    beside it: the same greedy tokens and routes, logprobs within 2e-5 in fp32. The tolerance: the fused path
    adds the shared output inside the fp32 sum over pairs, the separate one adds two fp32->fp32 results, so
    the sums may round differently in the last fp32 bits (2^-23 relative) per layer; 2e-5 on logprobs of
    order 1-6 leaves room for 3 layers of that and catches a wrongly split expert (errors of order 1e-1).
    n_shared = 2 (V2's layout): one MLP of 2 I split into two experts of I."""
    from bench.tiny_models import make_checkpoint
    from r3trace.engine import Engine

    ckpt = make_checkpoint(tmp_path / "ck", "v3_noaux_groups", seed=5, n_shared_experts=n_shared)
    prompts = random_prompts(3, 4, 13, seed=31)
    params = greedy(6)
    outs = {}
    for mode in ("separate", "fused"):
        eng = Engine(ckpt, moe_backend=moe_backend, topk_backend=moe_backend, shared_experts=mode, device=DEVICE,
                     kv_pool_tokens=240, chunked_prefill_size=8)  # fmt: skip
        moe = [m for m in eng.model.modules() if type(m).__name__ == "MoE"]
        assert moe and all((m.shared_experts is None) == (mode == "fused") for m in moe)
        assert all(m.w13.shape[0] == 8 + (n_shared if mode == "fused" else 0) for m in moe)
        outs[mode] = eng.generate(input_ids=prompts, sampling_params=params, return_routed_experts=True,
                                  return_logprob=True)
        eng.shutdown()
    for a, b in zip(outs["separate"], outs["fused"], strict=True):
        _completed(a, 6)
        _completed(b, 6)
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_array_equal(r3trace.decode_routed_experts(a["meta_info"]),
                                      r3trace.decode_routed_experts(b["meta_info"]))
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(lp_b, lp_a, rtol=0, atol=2e-5)


def test_replay_through_fused_shared_tail(make_engine: EngineFactory) -> None:
    """Routing replay when the top-k kernel writes the [T, K + S] routes: the forced ids replace the routed
    columns (the shared tail appended after them), reach the capturer, and give the ref backends' tokens."""
    from tests.capture.helpers import returned_routes

    p = random_prompts(1, 12, 12, seed=11)[0]
    ref = make_engine(device=DEVICE)
    tri = make_engine(device=DEVICE, moe_backend="triton", topk_backend="triton")
    moe = [m for m in tri.model.modules() if type(m).__name__ == "MoE"]
    assert moe and all(m.num_fused == 1 for m in moe)  # the tiny model's one shared expert, fused
    forced = returned_routes(ref.generate(input_ids=p, sampling_params=greedy(0), return_routed_experts=True))
    forced[:, 1:] = (forced[:, 1:] + 1) % 8  # every MoE layer's ids moved to experts the gate did not pick
    kw = dict(sampling_params=greedy(4), return_routed_experts=True, routed_experts=forced, return_logprob=True,
              logprob_start_len=0, routed_experts_replay_start_len=0)  # prompt rows forced, decode rows free
    a, b = ref.generate(input_ids=p, **kw), tri.generate(input_ids=p, **kw)
    assert a["output_ids"] == b["output_ids"]
    np.testing.assert_array_equal(returned_routes(b)[: len(p)], forced)
    np.testing.assert_array_equal(returned_routes(a), returned_routes(b))
    # The tokens alone do not tell the forced routes from the gate's on this tiny model (same 4 tokens), the
    # logprobs do: the gate's own routes move them by up to 0.68, the kernels' fp32 summation order by 5e-7
    # (both measured); 1e-4 sits between with 200x room on the one side and 6800x on the other.
    def logprobs(r: dict) -> list[float]:  # type: ignore[type-arg]
        m = r["meta_info"]
        return [x[0] for x in m["input_token_logprobs"][1:] + m["output_token_logprobs"]]

    np.testing.assert_allclose(logprobs(b), logprobs(a), rtol=0, atol=1e-4)
    natural = tri.generate(input_ids=p, **{**kw, "routed_experts": None, "routed_experts_replay_start_len": None})
    assert np.abs(np.subtract(logprobs(natural), logprobs(b))).max() > 0.1, "the forced routes reached the MoE"


def test_router_logits_are_whole_with_the_split_kernel(make_engine: EngineFactory) -> None:
    """Router.logits (replay_check's margin hook calls it) is [T, E] whatever the kernel hands the top-k
    (router_logits: [P, T, E] partial sums; one part at this D = 64, several in tests/kernels/test_topk.py). fp32
    on both sides: within 2 * D * 2^-24 * sum|x w| (two summation orders, test_topk.py's bound)."""
    gate = next(m for m in make_engine(device=DEVICE, topk_backend="triton").model.modules()
                if type(m).__name__ == "Router")
    x = torch.randn(7, gate.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = gate.logits(x)
    want = torch.nn.functional.linear(x, gate.weight)
    assert got.shape == want.shape == (7, gate.weight.shape[0])
    bound = 2 * x.shape[1] * 2.0**-24 * (x.abs() @ gate.weight.abs().T)
    assert bool(((got - want).abs() <= bound).all())


def test_one_attention_backend_for_every_layer(make_engine: EngineFactory) -> None:
    """The model builds one attention backend and every layer calls it: the decode kernel is resolved once, at
    construction, for this rank's heads and the latent shape (on CPU: the Triton stage 1)."""
    from r3trace.kernels.mla_decode import DecodeShape

    eng = make_engine(attention_backend="triton", device=DEVICE)
    layers = eng.model.model.layers
    assert len(layers) > 1 and len({id(layer.self_attn.backend) for layer in layers}) == 1
    attn = layers[0].self_attn
    decoder = attn.backend.decoder
    assert decoder.shape == DecodeShape(attn.h, attn.kv_lora, attn.rope_dim)
    assert decoder.stage1.name == ("triton" if DEVICE == "cpu" else decoder.stage1.name)
