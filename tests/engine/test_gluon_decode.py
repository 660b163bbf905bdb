"""The engine's MLA decode with the Gluon stage 1s (decode_kernel="auto" on Hopper) against the Triton kernel
(decode_kernel="triton"): bf16, kv_lora 128, rope 16, 64 heads (the wide kernel, kernels/mla_decode/wide.py) or 16
(the narrow one, kernels/mla_decode/narrow.py). GPU (sm_90) only: Gluon kernels do not run under TRITON_INTERPRET=1.

Run: .venv/bin/pytest -q -m gpu tests/engine/test_gluon_decode.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.tiny_models import make_checkpoint
from r3trace.engine import Engine
from r3trace.engine.layers.attention_backend import RefAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="the Gluon decode kernel is sm_90 only"),
]
# row_invariant off: its decode steps run the fixed-split kernel, never these decoders (the fast decode path is
# the one under test here)
TRITON = dict(attention_backend="triton", moe_backend="triton", topk_backend="triton", norm_backend="triton",
              rope_backend="triton", device="cuda", dtype="bfloat16", chunked_prefill_size=64, row_invariant=False)


def _uses_gluon(eng: Engine) -> bool:
    return all(layer.self_attn.backend.decoder.stage1.hopper for layer in eng.model.model.layers)


def _checkpoint(tmp_path: Path, heads: int = 64) -> Path:
    return make_checkpoint(tmp_path / f"h{heads}", "v3_noaux_groups", seed=7, num_attention_heads=heads,
                           num_key_value_heads=heads, kv_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=16,
                           v_head_dim=16, hidden_size=128, max_position_embeddings=1024)


def _decode_kernels(eng: Engine) -> set[str]:
    """The stage-1 record each layer's decoder resolved (one backend, so one decoder, shared by every layer)."""
    layers = eng.model.model.layers
    assert len({id(layer.self_attn.backend) for layer in layers}) == 1
    return {layer.self_attn.backend.decoder.stage1.name for layer in layers}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    # lengths across one and several 64-key tiles, and one split boundary or more
    return [rng.integers(2, 320, size=int(n)).tolist() for n in (5, 63, 64, 130, 300, 700)]


@pytest.mark.parametrize("heads", [64, 16])
def test_gluon_decode_matches_triton_kernel(tmp_path: Path, heads: int) -> None:
    ckpt, prompts = _checkpoint(tmp_path, heads), _prompts()
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    out = {}
    # 16 heads: 64-slot pages, where the default picks the narrow kernel (its TMA form; page size 1 keeps Triton's)
    page_size = 64 if heads == 16 else 1
    for kernel in ("auto", "triton"):
        with Engine(ckpt, decode_kernel=kernel, page_size=page_size, **TRITON) as eng:
            assert _uses_gluon(eng) == (kernel == "auto")
            want = {"auto": "wide" if heads == 64 else "narrow", "triton": "triton"}[kernel]
            assert _decode_kernels(eng) == {want}
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


def _decode_errors(eng: Engine, prompts: list[list[int]]) -> list[float]:
    """Greedy generation of 4 tokens, each decode attention call checked against RefAttention (fp32 softmax) on the
    same q and latent cache: the normwise errors (eager engines only: the wrapper must see every call)."""
    errors: list[float] = []
    ref = RefAttention()
    for layer in eng.model.model.layers:
        backend = layer.self_attn.backend
        kernel_call = backend.absorbed

        def checked(q, kv_cache, fb, kv_lora_rank, scale, kernel_call=kernel_call):  # type: ignore[no-untyped-def]
            out = kernel_call(q, kv_cache, fb, kv_lora_rank, scale)
            if fb.mode == "decode":
                want = ref.absorbed(q, kv_cache, fb, kv_lora_rank, scale).float()
                errors.append(float((out.float() - want).norm() / want.norm()))
            return out

        backend.absorbed = checked
    eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    return errors


@pytest.mark.parametrize("heads", [64, 16])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("kernel", ["auto", "triton"])
def test_every_decode_call_matches_torch_reference(tmp_path: Path, kernel: str, page_size: int, heads: int) -> None:
    """The end-to-end test above is weak (a tiny random model's logprobs are flat); this one checks each decode
    attention call the engine makes, every layer and step, against RefAttention (fp32 softmax) on the very
    same q and latent cache, eager (no graphs, so the wrapper sees every call). Page size 64: the Gluon
    kernel loads whole pages as TMA boxes (the engine passes its pool's page size to the decode tile)."""
    with Engine(_checkpoint(tmp_path, heads), decode_kernel=kernel, cuda_graph_batch_sizes=(), page_size=page_size,
                **TRITON) as eng:
        narrow = heads == 16 and page_size == 64
        want = "triton" if kernel == "triton" else "narrow" if narrow else "wide" if heads == 64 else "triton"
        assert _decode_kernels(eng) == {want}
        if want != "triton":  # the Gluon tiles carry the pool's page size (TMA tiles at 64)
            assert eng.model.model.layers[0].self_attn.backend.decoder.tile.page_size == page_size
        errors = _decode_errors(eng, _prompts())
    # 2 layers x 3 decode steps at least; P and O are rounded to bf16 (unit roundoff 2^-9 = 2e-3 each), so
    # the normwise error is a few 1e-3; 1e-2 still fails a wrong row, mask or softmax scale (errors of O(1))
    assert len(errors) >= 6
    assert max(errors) < 1e-2, errors


def test_narrow_cluster_merge_in_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 64 of 66-126-token contexts on 64-slot pages: the narrow tile takes 2 splits (128 programs, one wave),
    which its default merges in clusters of 2 (cluster_merge.py); every decode call still matches the fp32
    reference as above."""
    from r3trace.kernels.mla_decode import narrow

    clusters: list[tuple[int, bool]] = []  # (cluster size asked, launched as clusters)
    launch = narrow.launch_in_clusters

    def recorded(kernel, grid, cluster, *args):  # type: ignore[no-untyped-def]
        clusters.append((cluster, launch(kernel, grid, cluster, *args)))
        return clusters[-1][1]

    monkeypatch.setattr(narrow, "launch_in_clusters", recorded)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 320, size=int(n)).tolist() for n in rng.integers(66, 124, size=64)]
    with Engine(_checkpoint(tmp_path, 16), cuda_graph_batch_sizes=(), page_size=64, **TRITON) as eng:
        errors = _decode_errors(eng, prompts)
    assert clusters and set(clusters) == {(2, True)}, clusters
    assert max(errors) < 1e-2, errors


def test_seesaw_decode_in_engine(tmp_path: Path) -> None:
    """64 heads at rope 64 on 64-slot pages: the engine's H >= 64 tile is the seesaw kernel's
    (kernels/mla_decode/seesaw.py; it keeps P in a tile's rope rows, so rope 64 only); every decode call matches the
    fp32 reference as above."""
    ckpt = make_checkpoint(tmp_path / "h64r64", "v3_noaux_groups", seed=7, num_attention_heads=64,
                           num_key_value_heads=64, kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=16,
                           v_head_dim=16, hidden_size=128, max_position_embeddings=1024)  # fmt: skip
    with Engine(ckpt, cuda_graph_batch_sizes=(), page_size=64, **TRITON) as eng:
        assert _decode_kernels(eng) == {"seesaw"}
        errors = _decode_errors(eng, _prompts())
    assert len(errors) >= 6
    assert max(errors) < 1e-2, errors
