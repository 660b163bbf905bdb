"""Speculative decoding's options: SGLang's names on Engine and `r3trace serve`, each bad value or unsupported
combination a one-line error naming the field; checkpoints without (or with a broken) MTP layer refused.

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/spec/test_spec_config.py

Names and the EAGLE alias as SGLang's server_args (speculative_algorithm, speculative_num_steps; sgl-project/sglang
python/sglang/srt/server_args.py at 0114f9c).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from r3trace.engine import Engine
from r3trace.engine.engine_config import EngineConfig, EngineConfigError, default_batch_sizes
from r3trace.engine.weights import WeightsError

NEXTN: dict[str, Any] = {"speculative_algorithm": "NEXTN"}
TRITON_CUDA: dict[str, Any] = dict(device="cuda", attention_backend="triton", moe_backend="triton",
                                   topk_backend="triton")


@pytest.mark.parametrize(("options", "message"), [
    ({"speculative_algorithm": "MEDUSA"}, "speculative_algorithm='MEDUSA': expected one of (None, 'NEXTN', 'EAGLE')"),
    ({"speculative_algorithm": "nextn"}, "speculative_algorithm='nextn': expected one of"),
    ({"speculative_num_steps": 2}, "speculative_num_steps=2: given without speculative_algorithm"),
    ({**NEXTN, "speculative_num_steps": 0}, "speculative_num_steps=0: must be an integer in 1..3"),
    ({**NEXTN, "speculative_num_steps": 4}, "speculative_num_steps=4: must be an integer in 1..3"),
    ({**NEXTN, "speculative_num_steps": True}, "speculative_num_steps=True: must be an integer"),
    ({**NEXTN, "speculative_num_steps": "2"}, "speculative_num_steps='2': must be an integer"),
    ({**NEXTN, **TRITON_CUDA, "chunked_prefill_size": 64, "cuda_graph_batch_sizes": (8, 32, 16)},
     "cuda_graph_batch_sizes has [32]: a verify of B x (1 + speculative_num_steps 3) tokens must fit "
     "chunked_prefill_size=64 (B <= 16)"),
    ({**NEXTN, "device": "cuda", "cuda_graph_batch_sizes": (1, 2)},
     "cuda_graph_batch_sizes=(1, 2): needs device cuda and the triton attention, moe and topk backends (or "
     "deterministic=True)"),
])
def test_bad_options_are_one_line_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(EngineConfigError) as err:
        EngineConfig(**options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_defaults_and_derived_values() -> None:
    """Off by default; NEXTN or EAGLE with 3 steps unless told. The CUDA-graph ladder under speculation stops at the
    most verifies of 1 + d tokens one step's budget holds (a bigger step drafts less and runs eager); exact mode
    captures graphs only when told which."""
    assert EngineConfig().spec_steps == 0
    assert EngineConfig(speculative_algorithm="EAGLE").spec_steps == 3
    assert EngineConfig(speculative_algorithm="NEXTN", speculative_num_steps=1).spec_steps == 1
    assert EngineConfig(**TRITON_CUDA).graph_batch_sizes == default_batch_sizes(64)  # the ladder without speculation
    spec = EngineConfig(speculative_algorithm="NEXTN", **TRITON_CUDA)  # 512 tokens / 4 = 128 > 64 requests
    assert (spec.max_graph_batch, spec.graph_batch_sizes) == (64, default_batch_sizes(64))
    short = EngineConfig(speculative_algorithm="NEXTN", chunked_prefill_size=100, **TRITON_CUDA)  # 100 // 4
    assert (short.max_graph_batch, short.graph_batch_sizes) == (25, (1, 2, 4, 8, 16, 24, 25))
    one = EngineConfig(speculative_algorithm="NEXTN", speculative_num_steps=1, chunked_prefill_size=100, **TRITON_CUDA)
    assert one.max_graph_batch == 50
    assert EngineConfig(speculative_algorithm="NEXTN", chunked_prefill_size=3, **TRITON_CUDA).graph_batch_sizes == ()
    assert EngineConfig(speculative_algorithm="NEXTN", **TRITON_CUDA, cuda_graph_batch_sizes=()).graph_batch_sizes == ()
    exact = dict(deterministic=True, device="cuda")
    assert EngineConfig(**exact).graph_batch_sizes == ()
    assert EngineConfig(**exact, cuda_graph_batch_sizes=(1, 4), **NEXTN).graph_batch_sizes == (1, 4)


def test_several_processes_are_refused_before_any_rank_starts(mtp_ckpt: Path) -> None:
    for sizes in ({"tp_size": 2}, {"tp_size": 2, "dp_size": 2}, {"tp_size": 2, "ep_size": 2}):
        with pytest.raises(EngineConfigError, match=r"speculative_algorithm='NEXTN': one process only \(got tp_size=2"):
            Engine(mtp_ckpt, speculative_algorithm="NEXTN", **sizes)


def test_a_checkpoint_without_or_with_a_broken_mtp_layer_is_refused(mtp_ckpt: Path, tmp_path: Path) -> None:
    tensors = load_file(mtp_ckpt / "model.safetensors")

    def copy(name: str, keep: Any) -> Path:
        out = tmp_path / name
        out.mkdir()
        shutil.copy(mtp_ckpt / "config.json", out / "config.json")
        save_file({k: v for k, v in tensors.items() if keep(k)}, out / "model.safetensors")
        return out

    bare = copy("bare", lambda k: not k.startswith("model.layers.2."))
    with pytest.raises(EngineConfigError, match=r"the checkpoint has no MTP layer \(model.layers.2.\* tensors"):
        Engine(bare, speculative_algorithm="NEXTN")
    Engine(bare).shutdown()  # without speculation the MTP layer is not needed
    broken = copy("broken", lambda k: k != "model.layers.2.eh_proj.weight")
    with pytest.raises(WeightsError, match="missing: model.layers.2.eh_proj.weight"):
        Engine(broken, speculative_algorithm="NEXTN")


def test_serve_flags_reach_engine_config() -> None:
    """`r3trace serve MODEL --speculative-algorithm NEXTN --speculative-num-steps d --speculative-launch-steps S`."""
    from r3trace.cli import Parser
    from r3trace.commands import serve
    from r3trace.errors import UsageError

    p = Parser(prog="r3trace serve")
    serve.add_arguments(p)
    args = p.parse_args(["m", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--device", "cuda"])
    cfg = EngineConfig(**serve.engine_options(args))  # type: ignore[arg-type]
    assert (cfg.speculative_algorithm, cfg.spec_steps, cfg.graph_batch_sizes) == ("NEXTN", 2, default_batch_sizes(64))
    assert cfg.launch_steps == 4  # four greedy steps a launch by default on the graphs
    one = EngineConfig(**serve.engine_options(p.parse_args(["m", "--speculative-algorithm", "NEXTN", "--device", "cuda",
                                                            "--speculative-launch-steps", "1"])))  # type: ignore[arg-type]
    assert one.launch_steps == 1
    with pytest.raises(EngineConfigError, match="speculative_launch_steps=9: must be an integer in 1..8"):
        EngineConfig(**serve.engine_options(p.parse_args(["m", "--speculative-algorithm", "NEXTN",
                                                          "--speculative-launch-steps", "9"])))  # type: ignore[arg-type]
    assert EngineConfig(**serve.engine_options(p.parse_args(["m"]))).spec_steps == 0  # type: ignore[arg-type]
    both = EngineConfig(**serve.engine_options(p.parse_args(["m", "--device", "cuda", "--batch-invariant",
                                                             "--speculative-algorithm", "EAGLE"])))  # type: ignore[arg-type]
    assert both.batch_invariant and both.spec_steps == 3 and both.attention_impl == "invariant"
    assert not EngineConfig(**serve.engine_options(p.parse_args(["m"]))).batch_invariant  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="--speculative-algorithm"):
        p.parse_args(["m", "--speculative-algorithm", "NGRAM"])


def test_token_ids_logprob_is_served_as_without_speculation(make_spec_engine: Any, mtp_ckpt: Path) -> None:
    """token_ids_logprob: the listed ids' logprobs at every prompt position asked and at every committed token's row
    (an accepted draft's included), bitwise the plain engine's in exact mode; beside a request that lists none."""
    from tests.spec.test_spec_greedy import ASK, assert_mixed_acceptance, assert_same, engines, prompts

    spec, plain = engines(make_spec_engine, mtp_ckpt, 3, chunked_prefill_size=16)
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    ask = dict(ASK, logprob_start_len=2, token_ids_logprob=[[3, 7, 11], [], [5], [2, 9], [40, 41, 42, 43], [6]])
    got = spec.generate(input_ids=prompts(seed=9), sampling_params=sp, **ask)
    want = plain.generate(input_ids=prompts(seed=9), sampling_params=sp, **ask)
    assert_same(got, want)
    assert_mixed_acceptance(got)
    m = got[0]["meta_info"]
    assert len(m["output_token_ids_logprobs"]) == 12 and [e[1] for e in m["output_token_ids_logprobs"][5]] == [3, 7, 11]
    assert len(m["input_token_ids_logprobs"]) == len(prompts(seed=9)[0]) - 2
