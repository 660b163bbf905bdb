"""Ours as SGLang's EPLB algorithm (r3trace/eplb/sglang_plugin.py). The contract encoded here, from SGLang 0.5.23's
wheel: ExpertLocationMetadata.init_by_eplb (srt/eplb/expert_location.py) calls
eplb_algorithms.rebalance_experts(tokens_per_expert=[S, L, E] counts, num_physical_experts=P,
num_local_physical_experts=P / GPUs, num_groups (None without groups), num_nodes, algorithm=EplbAlgorithm) by
keyword and takes (phy2log [L, P], log2phy [L, E, X], logcnt [L, E]) back, X the largest count (it pads to P);
HookRegistry.register(target, hook, HookType.AROUND) makes the function call hook(original, *args, **kwargs).
Checked once beside SGLang 0.5.23 itself (its plugin loader and HookRegistry; not run here, since SGLang is not a
dependency): the test at the bottom runs wherever SGLang is importable.
Run: .venv/bin/pytest tests/analysis/test_eplb_sglang_plugin.py -q"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from enum import Enum, auto
from typing import Any

import numpy as np
import pytest
import torch

from r3trace.eplb import Cluster, churn, from_phy2log, global_policy
from r3trace.eplb.config import PlannerConfig
from r3trace.eplb.dropin import rebalance_experts
from r3trace.eplb.evaluate import planner_config
from r3trace.eplb.score import balancedness, even_gpu_load
from r3trace.eplb.served import TOP_K_ENV, TOPK_GROUP_ENV
from r3trace.eplb.sglang_plugin import ENV, TARGET, SglangHook, install, register


class EplbAlgorithm(Enum):  # SGLang 0.5.23's eplb_algorithms.EplbAlgorithm
    deepseek = auto()
    deepseek_hierarchical = auto()
    deepseek_vec = auto()
    deepseek_vec_hierarchical = auto()
    elasticity_aware = auto()
    elasticity_aware_hierarchical = auto()


def counts(layers: int, experts: int, seed: int, steps: int = 4, base_seed: int = 0) -> torch.Tensor:
    """The recorder's logical counts [S, L, E] (int32) of one router (base_seed), sampled anew (seed)."""
    base = np.random.default_rng(base_seed).gamma(0.7, 25.0, (layers, experts)) + 0.25
    return torch.from_numpy(np.random.default_rng(1000 + seed).poisson(base, (steps, layers, experts)).astype(np.int32))


def never(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the original algorithm ran where ours plans")


def planned(hook: SglangHook, c: torch.Tensor, slots: int, gpus: int, groups: int | None, nodes: int,
            algorithm: EplbAlgorithm = EplbAlgorithm.deepseek_hierarchical) -> tuple[torch.Tensor, ...]:
    """As init_by_eplb calls the hooked function: by keyword."""
    return hook(never, tokens_per_expert=c, num_physical_experts=slots, num_local_physical_experts=slots // gpus,
                num_groups=groups, num_nodes=nodes, algorithm=algorithm)


@pytest.mark.parametrize("flag", [None, "0"])
def test_installed_beside_sglang_it_hooks_nothing_until_asked(flag: str | None) -> None:
    hooks: list[tuple[Any, ...]] = []
    assert install(lambda *a: hooks.append(a), "AROUND", {} if flag is None else {ENV: flag}, None) is None
    assert hooks == []


def test_asked_it_hooks_sglangs_function_around_and_a_bad_switch_is_named() -> None:
    hooks: list[tuple[Any, ...]] = []
    hook = install(lambda *a: hooks.append(a), "AROUND", {ENV: "1"}, "static")
    assert hooks == [(TARGET, hook, "AROUND")] and isinstance(hook, SglangHook)
    with pytest.raises(ValueError, match=f"^{ENV}='on': use 1"):
        install(lambda *a: None, "AROUND", {ENV: "on"}, None)


def test_the_router_variables_reach_the_plan() -> None:
    """R3TRACE_EPLB_TOP_K / _TOPK_GROUP: the router ours assumes without tokens (P = E on several nodes): the hook
    plans as ours with that router, which here differs from ours with V3's; a bad value fails at install."""
    c = counts(2, 64, 0)
    hook = install(lambda *a: None, "AROUND", {ENV: "1", TOP_K_ENV: "2", TOPK_GROUP_ENV: "1"}, None)
    assert hook is not None
    got = planned(hook, c, 64, 32, 8, 2)[0]  # 32 GPUs on 2 nodes, two experts a GPU
    want = rebalance_experts(c.sum(0), 64, 8, 2, 32, history=c.sum(0, keepdim=True).double(),
                             cfg=PlannerConfig(router_top_k=2, router_topk_group=1))[0]
    v3 = planned(SglangHook(None), c, 64, 32, 8, 2)[0]
    assert torch.equal(got, want) and not torch.equal(got, v3)
    with pytest.raises(ValueError, match=f"^{TOP_K_ENV}='0': must be an integer >= 1$"):
        install(lambda *a: None, "AROUND", {ENV: "1", TOP_K_ENV: "0"}, None)


@pytest.mark.parametrize(("layers", "experts", "slots", "groups", "nodes", "gpus"),
                         [(3, 64, 72, 8, 2, 8), (2, 20, 24, 4, 1, 6), (4, 32, 32, None, 2, 4)])
def test_the_hook_returns_what_init_by_eplb_takes(layers: int, experts: int, slots: int, groups: int | None,
                                                  nodes: int, gpus: int) -> None:
    c = counts(layers, experts, 0)
    phy2log, log2phy, logcnt = planned(SglangHook(None), c, slots, gpus, groups, nodes)
    for t in (phy2log, log2phy, logcnt):
        assert t.dtype == torch.int64 and t.device.type == "cpu"
    assert phy2log.shape == (layers, slots) and log2phy.shape == (layers, experts, int(logcnt.max()))
    for layer in range(layers):
        for e in range(experts):
            got = log2phy[layer, e][log2phy[layer, e] >= 0]
            assert len(got) == logcnt[layer, e] >= 1 and bool((phy2log[layer, got] == e).all())
    want = rebalance_experts(c.sum(0), slots, groups or 1, nodes, gpus, history=c.sum(0, keepdim=True).double())
    np.testing.assert_array_equal(phy2log.numpy(), want[0].numpy())  # the buffer's rows summed: one window


def test_elastic_ep_keeps_sglangs_own_algorithm() -> None:
    seen: list[Any] = []
    c = counts(2, 16, 1)
    out = SglangHook(None)(lambda *a: seen.append(a) or "theirs", c, 24, 3, 4, 1, EplbAlgorithm.elasticity_aware)
    assert out == "theirs" and seen == [(c, 24, 3, 4, 1, EplbAlgorithm.elasticity_aware)]


def test_its_own_last_plan_bounds_the_weights_moved() -> None:
    # init_by_eplb hands no map in service: the hook's last plan of these sizes stands in; DeepSeek's algorithm
    # (SGLang's deepseek) re-packs from scratch
    hook, cl = SglangHook(None), Cluster(16, 2, 96, num_groups=8)
    first = from_phy2log(planned(hook, counts(4, 64, 1), 96, 16, 8, 2)[0].numpy(), 64)
    again = from_phy2log(planned(hook, counts(4, 64, 2), 96, 16, 8, 2)[0].numpy(), 64)
    fresh = churn(global_policy(counts(4, 64, 1).sum(0).double().numpy(), cl),
                  global_policy(counts(4, 64, 2).sum(0).double().numpy(), cl))
    assert churn(first, again) <= 0.10 < 0.5 < fresh  # measured: 0.081 and 0.93
    other = planned(hook, counts(4, 64, 3), 112, 16, 8, 2)[0]  # other sizes: no previous, no history
    np.testing.assert_array_equal(other.numpy(), planned(SglangHook(None), counts(4, 64, 3), 112, 16, 8, 2)[0].numpy())


def test_dense_layers_zero_rows_plan_without_nan() -> None:
    c = counts(4, 32, 4)
    c[:, 0] = 0  # SGLang's counts hold every hidden layer; the dense ones route nothing
    hook = SglangHook(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in (4, 5):
            c = counts(4, 32, seed)
            c[:, 0] = 0
            phy2log = planned(hook, c, 40, 8, 4, 2)[0]
    assert sorted(set(phy2log[0].tolist())) == list(range(32))


def test_it_plans_for_sglangs_dispatch_read_once() -> None:
    reads: list[int] = []

    def dispatch() -> str:
        reads.append(1)
        return "static"

    hook = SglangHook(dispatch)
    for seed in range(2):
        planned(hook, counts(2, 32, seed), 40, 8, 4, 2)
    assert reads == [1] and hook.cfg == planner_config("static")
    for name, cfg in (("dynamic", planner_config("dynamic")), ("lp", PlannerConfig()), (None, PlannerConfig())):
        other = SglangHook(name)
        planned(other, counts(2, 32, 0), 40, 8, 4, 2)
        assert other.cfg == cfg


def test_beside_sglang_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    hook_registry = pytest.importorskip("sglang.srt.plugins.hook_registry")
    from sglang.srt.eplb import eplb_algorithms  # type: ignore[import-not-found]

    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(hook_registry.HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(hook_registry.HookRegistry, "_patched", set())
    monkeypatch.setattr(eplb_algorithms, "rebalance_experts", eplb_algorithms.rebalance_experts)  # put back after
    register()
    hook_registry.HookRegistry.apply_hooks()
    c = counts(3, 64, 7)
    phy2log, _, logcnt = eplb_algorithms.rebalance_experts(
        tokens_per_expert=c, num_physical_experts=72, num_local_physical_experts=9, num_groups=8, num_nodes=2,
        algorithm=eplb_algorithms.compute_algorithm("auto", 8, 2))
    want = rebalance_experts(c.sum(0), 72, 8, 2, 8, history=c.sum(0, keepdim=True).double())
    np.testing.assert_array_equal(phy2log.numpy(), want[0].numpy())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_counts_on_the_gpu_plan_as_on_the_host() -> None:
    # SGLang's recorder hands its counts on the device; the maps come back on the host, as DeepSeek's do
    on_gpu, on_host = SglangHook(None), SglangHook(None)
    for seed in range(3):
        c = counts(3, 64, seed)
        got = planned(on_gpu, c.cuda(), 72, 8, 8, 2)
        want = planned(on_host, c, 72, 8, 8, 2)
        for g, w in zip(got, want, strict=True):
            assert g.device.type == "cpu"
            np.testing.assert_array_equal(g.numpy(), w.numpy())


def test_each_rebalance_says_in_sglangs_log_what_it_did(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="r3trace.eplb")  # SGLang configures the root logger, which prints it
    hook = install(lambda *a: None, "AROUND", {ENV: "1"}, None)
    assert hook is not None
    first = planned(hook, counts(3, 64, 1), 72, 8, 8, 2)[0]
    c = counts(3, 64, 2)
    again = planned(hook, c, 72, 8, 8, 2)[0]
    moved = float((again != first).double().mean())
    cl = Cluster(8, 2, 72)
    bal = balancedness(even_gpu_load(from_phy2log(again.numpy(), 64), c.sum(0).double().numpy(), cl))
    lines = [r.getMessage() for r in caplog.records if r.name == "r3trace.eplb"]
    assert lines[0] == f"r3trace EPLB: ours plans SGLang's EPLB rebalances ({ENV}=1)"
    assert lines[1].startswith("r3trace EPLB in SGLang: 3 layers x 72 slots on 8 GPUs / 2 nodes, planned on 1 window")
    assert "planned on 2 window(s)" in lines[2] and f"{moved:.1%} of slots moved, balancedness {bal:.3f}" in lines[2]
