"""A random DeepSeek-V3 checkpoint in the Hugging Face layout, generated on the GPU in seconds.

transformers' own init of a 2.5B-parameter model runs on the CPU for minutes; here every tensor is drawn
on the device (normal, std 0.02; norms 1; the router bias 0) and written as bf16 safetensors shards, with
a config.json that both transformers' DeepseekV3ForCausalLM and our engine read. Shapes for throughput
benchmarks, not for quality: random routers route almost uniformly.

Run:   python -m bench.random_checkpoint OUT_DIR --shape v3-2.5b   (on the GPU when there is one)
Smoke: python -m bench.random_checkpoint --smoke                   (the tiny shape into a temporary folder, CPU)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from r3trace.engine.model_config import ModelConfig

SHAPES: dict[str, dict[str, Any]] = {
    # issue 6's end-to-end shape: hidden 2048, 12 layers, 64 experts top-6, bf16 (about 2.5B parameters)
    "v3-2.5b": dict(hidden_size=2048, num_hidden_layers=12, intermediate_size=5632, moe_intermediate_size=512,
                    num_attention_heads=16, q_lora_rank=768, n_routed_experts=64, num_experts_per_tok=6,
                    n_group=8, topk_group=4),
    "tiny": dict(hidden_size=64, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                 num_attention_heads=2, q_lora_rank=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                 topk_group=2),
    "v3-1b": dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=2816, moe_intermediate_size=512,
                  num_attention_heads=16, q_lora_rank=512, n_routed_experts=64, num_experts_per_tok=6,
                  n_group=8, topk_group=4),
    # DeepSeek-V3's attention and its per-rank MoE shape under TP8 (D = 7168, E = 256, I = 2048 / 8, top-8, 8 groups
    # of which 4 are kept), 3 layers (1 dense + 2 MoE): 4.2B parameters, 8.5 GB in bf16, one GPU holds it whole
    "v3-moe256": dict(hidden_size=7168, num_hidden_layers=3, intermediate_size=18432, moe_intermediate_size=256,
                      num_attention_heads=128, q_lora_rank=1536, n_routed_experts=256, num_experts_per_tok=8,
                      n_group=8, topk_group=4),
}
COMMON: dict[str, Any] = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=32000, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_shared_experts=1, first_k_dense_replace=1,
    moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=2.5, rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=10000.0,
    rope_interleave=True, hidden_act="silu", tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    num_nextn_predict_layers=0, attention_bias=False, torch_dtype="bfloat16",
)


def tensor_shapes(c: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor name and shape of the HF layout for config c."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    qk, v, kvl, rope = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"], c[
        "qk_rope_head_dim"]
    yield "model.embed_tokens.weight", (c["vocab_size"], d)
    for i in range(c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}"
        if i >= c["num_hidden_layers"]:  # an MTP (NextN) layer: its own projections, then a MoE decoder layer
            yield from ((f"{p}.{n}.weight", (d,)) for n in ("enorm", "hnorm", "shared_head.norm"))
            yield f"{p}.eh_proj.weight", (d, 2 * d)
        yield f"{p}.input_layernorm.weight", (d,)
        yield f"{p}.post_attention_layernorm.weight", (d,)
        yield f"{p}.self_attn.q_a_proj.weight", (c["q_lora_rank"], d)
        yield f"{p}.self_attn.q_a_layernorm.weight", (c["q_lora_rank"],)
        yield f"{p}.self_attn.q_b_proj.weight", (h * qk, c["q_lora_rank"])
        yield f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kvl + rope, d)
        yield f"{p}.self_attn.kv_a_layernorm.weight", (kvl,)
        yield f"{p}.self_attn.kv_b_proj.weight", (h * (c["qk_nope_head_dim"] + v), kvl)
        yield f"{p}.self_attn.o_proj.weight", (d, h * v)
        if i < c["first_k_dense_replace"]:
            inter = c["intermediate_size"]
            yield from ((f"{p}.mlp.{n}.weight", s) for n, s in
                        (("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))))
            continue
        inter = c["moe_intermediate_size"]
        yield f"{p}.mlp.gate.weight", (c["n_routed_experts"], d)
        yield f"{p}.mlp.gate.e_score_correction_bias", (c["n_routed_experts"],)
        for e in range(c["n_routed_experts"]):
            yield from ((f"{p}.mlp.experts.{e}.{n}.weight", s) for n, s in
                        (("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))))
        si = inter * c["n_shared_experts"]
        yield from ((f"{p}.mlp.shared_experts.{n}.weight", s) for n, s in
                    (("gate_proj", (si, d)), ("up_proj", (si, d)), ("down_proj", (d, si))))
    yield "model.norm.weight", (d,)
    yield "lm_head.weight", (c["vocab_size"], d)


def write_random_checkpoint(out: Path, shape: str, device: str, seed: int = 0, shard_bytes: int = 2 << 30,
                            mtp: bool = False) -> Path:
    """SHAPES[shape] as bf16 safetensors shards under out, every tensor drawn on `device`; mtp: with one MTP layer
    (num_nextn_predict_layers = 1, DeepSeek-V3's layout: the speculative engine's NextN draft; random, so its drafts
    are not accepted: for timing a step, not acceptance)."""
    cfg = {**COMMON, **SHAPES[shape], "num_nextn_predict_layers": int(mtp)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    size = n_shard = 0

    def flush() -> None:
        nonlocal shard, size, n_shard
        if shard:
            name = f"model-{n_shard:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, n_shard = {}, 0, n_shard + 1

    for name, shp in tensor_shapes(cfg):
        if name.endswith("e_score_correction_bias"):
            t = torch.zeros(shp, dtype=torch.float32)  # DeepSeek ships the bias in fp32
        elif "norm" in name:
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            t = torch.empty(shp, device=device).normal_(0.0, 0.02, generator=gen).to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def smoke_speculation(path: Path) -> None:
    """The MTP layer loads as the NextN draft: exact mode, greedy speculation gives plain greedy decoding's tokens."""
    from r3trace.engine import Engine

    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(path, deterministic=True, speculative_algorithm="NEXTN") as spec, \
            Engine(path, deterministic=True) as plain:
        got, want = (e.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)["output_ids"] for e in (spec, plain))
    if got != want:
        raise SystemExit(f"speculation on the random MTP layer gave {got}, plain decoding {want}")
    print(f"speculation on the random MTP layer: {got} as plain decoding")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="", help="the checkpoint folder (required but in --smoke)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="v3-2.5b")
    ap.add_argument("--mtp", action="store_true", help="with one MTP (NextN) layer, for speculative decoding")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape into a temporary folder on the CPU")
    args = ap.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_random_checkpoint(Path(tmp) / "tiny", "tiny", "cpu", mtp=True)
            ModelConfig.from_hf(path)  # the engine reads what was written
            print(f"wrote {path} ({sum(1 for _ in path.glob('*.safetensors'))} shards)")
            smoke_speculation(path)
        return
    if not args.out:
        ap.error("OUT_DIR is required")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = write_random_checkpoint(Path(args.out), args.shape, device, mtp=args.mtp)
    print(f"wrote {path} ({sum(1 for _ in path.glob('*.safetensors'))} shards)")


if __name__ == "__main__":
    main()
