"""Tensor parallelism at the model level: two gloo processes against the one-process model.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_tensor_parallel.py

Real processes (torch.multiprocessing spawn, gloo over a FileStore): each rank builds the tp=2 model from the
same tiny checkpoint, its weights sliced at load time, and runs the same prefix-free ForwardBatch.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from bench.spawn import spawn_ranks
from bench.tiny_models import direct_forward, load_engine_model, make_checkpoint
from r3trace.engine.distributed import init_parallel
from r3trace.engine.layers.linear import VocabParallelEmbedding, shards
from r3trace.engine.parallel import ParallelInfo, group_ranks
from r3trace.engine.weights import WeightsError

# fp32. The one-process model sums o_proj's, the dense MLP's and the shared experts' inner products over all
# heads / the whole intermediate in one GEMM; tp=2 sums two halves and adds them in the all-reduce. Only the
# order of fp32 additions differs: an ulp or two per sum (|logit| <= 2.9 here, ulp 2.4e-7), carried through
# 3-4 layers, their norms and the final norm: measured worst 1.8e-6 on these cases (torch 2.13 CPU).
# 1e-5 leaves room for other BLAS blockings; a missing reduction is off by ~3.
LOGITS_ATOL = 1e-5
TP = 2
# (checkpoint config, mla_path, shared_experts): q_b_proj and q_proj heads, both MLA paths, split shared
# experts (row-parallel, reduced) and fused ones (replicated with the routed experts), a V2 stack with no
# dense layer.
CASES = [
    ("v3_noaux_groups", "normal", "separate"),
    ("v3_noaux_groups", "absorb", "separate"),
    ("v3_qproj_nonorm", "normal", "fused"),
    ("v3_qproj_nonorm", "absorb", "separate"),
    ("v2_group_limited", "normal", "separate"),
]
TOKENS = torch.randint(2, 320, (23,), generator=torch.Generator().manual_seed(5)).tolist()


def _run(ckpts: dict[str, Path], parallel: ParallelInfo | None) -> list[dict[str, Any]]:
    out = []
    for name, mla_path, shared in CASES:
        torch.manual_seed(0)
        model = load_engine_model(ckpts[name], parallel=parallel, mla_path=mla_path, shared_experts=shared)
        logits, routes = direct_forward(model, TOKENS)
        out.append({"logits": logits, "routes": {k: v.clone() for k, v in routes.items()}})
    return out


def _worker(rank: int, store: str, ckpts: dict[str, Path], out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    # A rank that fails before a collective must not leave the other waiting for gloo's 30-minute default.
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=TP, timeout=timeout)
    try:
        parallel = init_parallel(TP, timeout=timeout)
        sizes = [dist.get_world_size(g) for g in (parallel.tp_group, parallel.attn_tp_group, parallel.ep_group)]
        assert sizes == [TP, TP, 1] and dist.get_world_size(parallel.dp_group) == 1, sizes
        torch.save(_run(ckpts, parallel), out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tp2_matches_one_process(tmp_path: Path) -> None:
    ckpts = {name: make_checkpoint(tmp_path / name, name, seed=7) for name in {c[0] for c in CASES}}
    spawn_ranks(_worker, (str(tmp_path / "store"), ckpts, tmp_path), TP)
    ref = _run(ckpts, None)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(TP)]
    for case, r0, r1 in zip(CASES, *ranks, strict=True):  # every rank holds the reduced / gathered result
        assert torch.equal(r0["logits"], r1["logits"]), f"{case}: ranks disagree"
    for rank in range(TP):
        for case, r, g in zip(CASES, ref, ranks[rank], strict=True):
            worst = (g["logits"] - r["logits"]).abs().max().item()
            assert worst < LOGITS_ATOL, f"rank {rank} {case}: worst logit difference {worst:.2e}"
            assert sorted(g["routes"]) == sorted(r["routes"]), case
            for layer_id, ids in r["routes"].items():
                assert torch.equal(g["routes"][layer_id], ids), f"rank {rank} {case} layer {layer_id}: routes differ"


def _sglang_ranks(tp_rank: int, tp_size: int, dp_size: int, ep_size: int) -> tuple[int, int, int, int]:
    """SGLang's formulas (compute_dp_attention_world_info; initialize_model_parallel's moe_ep groups)."""
    attn_tp_size = tp_size // dp_size
    moe_tp_size = tp_size // ep_size
    return attn_tp_size, tp_rank % attn_tp_size, tp_rank // attn_tp_size, tp_rank // moe_tp_size


LAYOUTS = [(1, 1, 1), (2, 1, 2), (2, 2, 1), (4, 2, 4), (8, 2, 4), (8, 4, 8), (8, 8, 1)]  # (tp, dp, ep)


@pytest.mark.parametrize(("tp", "dp", "ep"), LAYOUTS)
def test_derived_ranks_and_groups_follow_sglang(tp: int, dp: int, ep: int) -> None:
    groups = group_ranks(tp, dp, ep)
    for rank in range(tp):
        p = ParallelInfo(rank, tp, dp, ep)
        attn_tp_size, attn_tp_rank, attn_dp_rank, ep_rank = _sglang_ranks(rank, tp, dp, ep)
        assert (p.attn_tp_size, p.attn_tp_rank, p.attn_dp_rank, p.dp_rank, p.ep_rank) == (
            attn_tp_size, attn_tp_rank, attn_dp_rank, attn_dp_rank, ep_rank
        )
        # Each rank is in exactly one group of each kind, at the position of its rank within that group.
        mine = {kind: [g for g in gs if rank in g] for kind, gs in groups.items()}
        assert all(len(g) == 1 for g in mine.values()), mine
        assert mine["tp"][0] == list(range(tp))
        assert mine["attn_tp"][0].index(rank) == p.attn_tp_rank and len(mine["attn_tp"][0]) == p.attn_tp_size
        assert mine["dp"][0].index(rank) == p.attn_dp_rank and len(mine["dp"][0]) == dp
        assert mine["ep"][0].index(rank) == p.ep_rank and len(mine["ep"][0]) == ep


@pytest.mark.parametrize("bad", [dict(tp_size=4, dp_size=3), dict(tp_size=2, ep_size=4), dict(tp_rank=2, tp_size=2)])
def test_parallel_info_rejects_bad_layouts(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ParallelInfo(**bad)


# Loading needs no process group: a rank's model is built from its ParallelInfo (groups None) and only its
# forward communicates.
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tp") / "m", "v3_noaux_groups", seed=7)


@pytest.mark.parametrize("rank", range(TP))
def test_each_rank_loads_its_slice(ckpt: Path, rank: int) -> None:
    model = load_engine_model(ckpt, parallel=ParallelInfo(rank, TP), shared_experts="separate")
    full = load_file(ckpt / "model.safetensors")
    params = dict(model.named_parameters())
    sharded = shards(model)
    kinds = {name.split(".")[-2] for name in sharded}
    assert kinds == {"embed_tokens", "lm_head", "q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"}, kinds
    assert any(".shared_experts." in name for name in sharded)
    for name, param in params.items():
        want = full.get(name)
        if name in sharded:
            dim, r, size = sharded[name]
            n = param.shape[dim]
            assert n * size == want.shape[dim]
            assert torch.equal(param, want.narrow(dim, r * n, n)), name
        elif want is not None:  # replicated: the latent path, norms, router (w13 / w2: no checkpoint name)
            assert torch.equal(param, want), name
    attn = model.decoder_layers()[0].self_attn
    assert attn.h == model.config.num_attention_heads // TP and attn.w_kc.shape[0] == attn.h


def test_sharded_load_errors_are_listed_together(ckpt: Path, tmp_path: Path) -> None:
    d = tmp_path / "w"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.0.self_attn.o_proj.weight"]
    tensors["model.layers.1.self_attn.kv_b_proj.weight"] = tensors["model.layers.1.self_attn.kv_b_proj.weight"][:40]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightsError) as info:
        load_engine_model(d, parallel=ParallelInfo(1, TP))
    msg = str(info.value)
    assert "missing: model.layers.0.self_attn.o_proj.weight" in msg
    assert "kv_b_proj.weight: checkpoint shape (40, 16) != model (80, 16)" in msg  # the full shape, not the shard


def test_vocab_parallel_lookups_sum_to_the_full_lookup() -> None:
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(12, 5, generator=gen)
    ids = torch.tensor([0, 5, 6, 11, 3, 6])
    total = torch.zeros(len(ids), 5)
    for rank in range(3):
        emb = VocabParallelEmbedding(12, 5, rank, 3, torch.float32, "cpu")
        emb.weight.data.copy_(table[rank * 4 : (rank + 1) * 4])
        part = emb(ids)
        assert (part.abs().sum(-1) > 0).tolist() == [(rank * 4 <= i < rank * 4 + 4) for i in ids.tolist()]
        total += part
    assert torch.equal(total, table[ids])


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    raise SystemExit(pytest.main([__file__, "-q"]))
