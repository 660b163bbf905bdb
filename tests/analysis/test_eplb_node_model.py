"""node_model.expected_nodes (expected nodes per token from loads, for plans without tokens) by hand, against sampling
its own generative model, and the plan it steers: P = E, no tokens (an SGLang dump), the candidates tied on the max
load compete on it. Run: .venv/bin/pytest tests/analysis/test_eplb_node_model.py -q"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.eplb_traces import TraceSpec, synth_windows
from r3trace.eplb import Cluster, PlacementError, plan
from r3trace.eplb.candidates import Contest, token_nodes
from r3trace.eplb.deepseek import global_phy2log
from r3trace.eplb.node_model import expected_nodes

CL4 = Cluster(2, 2, 4, num_groups=2)  # 2 nodes of 1 GPU, 2 slots each; experts 0-1 group 0, 2-3 group 1
W4 = np.array([[3.0, 1.0, 2.0, 2.0]])  # W_g = 4, 4: each group taken with 0.5; top_k 2 of one group


def test_by_hand() -> None:
    # p = min(1, 2 w_e / 4) = 1, 0.5, 1, 1. Groups on their own nodes: a taken group's experts sit on one node, so
    # P(miss n) = 1 - 0.5 for each node, 1.0 expected
    assert expected_nodes(np.array([[0, 1, 2, 3]]), W4, CL4, 2, 1) == pytest.approx([1.0], abs=1e-15)
    # node 0 holds experts 0 and 2, node 1 experts 1 and 3: P(miss 0) = (1 - .5 + .5 * 0)(1 - .5 + .5 * 0) = 0.25,
    # P(miss 1) = (1 - .5 + .5 * .5)(1 - .5 + .5 * 0) = 0.375: 0.75 + 0.625
    assert expected_nodes(np.array([[0, 2, 1, 3]]), W4, CL4, 2, 1) == pytest.approx([1.375], abs=1e-15)


def test_one_group_is_the_independent_model() -> None:
    rng = np.random.default_rng(3)
    cl = Cluster(6, 3, 12, num_groups=1)
    w = rng.gamma(0.7, size=(2, 12))
    ph = np.stack([rng.permutation(12) for _ in range(2)])
    p = np.minimum(1.0, 3 * w / w.sum(1, keepdims=True))
    node_of = np.empty_like(ph)
    node_of[np.arange(2)[:, None], ph] = cl.slot_node()[None, :]
    want = [sum(1 - np.prod(1 - p[i][node_of[i] == n]) for n in range(3)) for i in range(2)]
    np.testing.assert_allclose(expected_nodes(ph, w, cl, 3, 0), want, rtol=1e-13)


@pytest.mark.parametrize("seed", range(3))
def test_equals_sampling_its_model(seed: int) -> None:
    """Odd shape: 18 experts in 3 groups of 6 on 3 nodes; groups and experts drawn as the module doc says."""
    rng = np.random.default_rng(seed)
    cl, e, k, tg = Cluster(9, 3, 18, num_groups=3), 18, 4, 2
    w = rng.gamma(0.8, size=(1, e)) * 100
    ph = rng.permutation(e)[None, :]
    node_of = np.empty(e, dtype=np.int64)
    node_of[ph[0]] = cl.slot_node()
    w_gr = w[0].reshape(3, 6).sum(1)
    q = np.minimum(1.0, tg * w_gr / w.sum())
    p = np.minimum(1.0, (k / tg) * w[0] / np.repeat(w_gr, 6))
    t = 200_000
    chosen = (rng.random((t, e)) < p) & np.repeat(rng.random((t, 3)) < q, 6, axis=1)  # [T, E]
    hit = np.stack([chosen[:, node_of == n].any(1) for n in range(3)], 1)  # [T, N]
    got = expected_nodes(ph, w, cl, k, tg)[0]
    assert abs(got - hit.sum(1).mean()) < 5 * hit.sum(1).std() / np.sqrt(t)


def test_bad_router_fields() -> None:
    with pytest.raises(PlacementError, match="topk_group=3 must be <= num_groups=2"):
        expected_nodes(np.array([[0, 1, 2, 3]]), W4, CL4, 2, 3)
    with pytest.raises(PlacementError, match="top_k=0"):
        expected_nodes(np.array([[0, 1, 2, 3]]), W4, CL4, 0, 1)


def test_contest_without_tokens_takes_the_fewest_expected_nodes() -> None:
    """Tied on the max load (every GPU 6: a hot and a cold expert), ours with the two hottest experts on two nodes,
    the other candidates with both on node 0: the independent model (one group, top-2) misses node 0 with 0.2858 and
    node 1 with 0.3086 there against 0.2970 twice, so without tokens the contest leaves ours."""
    cl = Cluster(4, 2, 8, num_groups=1)
    w = np.array([[5.0, 5.0, 4.0, 4.0, 1.0, 1.0, 2.0, 2.0]])  # a b c d e f g h: pairs (a e) (b f) (c g) (d h)
    ours = np.array([[0, 4, 2, 6, 1, 5, 3, 7]])  # node 0: a e c g, node 1: b f d h
    glob = np.array([[0, 4, 1, 5, 2, 6, 3, 7]])  # node 0: a e b f, node 1: c g d h
    con = Contest(ours, w, cl, None, glob=glob, router=(2, 0))
    assert con.tied[:, 0].all()
    est = [expected_nodes(c, w, cl, 2, 0)[0] for c in con.cands]
    assert est[0] == pytest.approx(2 - 2 * 0.2970, abs=1e-3) and est[2] == pytest.approx(2 - 0.5944, abs=1e-3)
    assert con.layouts(np.array([0]))[0].tolist() == con.cands[int(np.argmin(est)), 0].tolist() != ours[0].tolist()


def test_a_plan_without_tokens_keeps_global_s_locality() -> None:
    """SGLang-dump-like: the grouped router at s = 1.2 on 128 GPUs / 16 nodes / 256 slots, the planner given counts
    only: nodes per token on the next window's tokens within forecast noise of DeepSeek global's (ours picks global's
    layouts on its own forecast), where ours' group homes, the first tied candidate, sit 1.6 above."""
    spec = TraceSpec(zipf_s=1.2, num_layers=2, windows=3, window_tokens=2048, seed=0)
    routes = synth_windows(spec)  # [W, T, L, K]
    heats = np.stack([np.stack([np.bincount(r[:, li].ravel(), minlength=256) for li in range(2)]) for r in routes])
    cl = Cluster(128, 16, 256, num_groups=8)
    ours = plan(heats[:2].astype(np.float64), cl)
    theirs = token_nodes(global_phy2log(heats[:2].sum(0).astype(np.float64), cl), routes[2], cl).mean()
    assert token_nodes(ours.phy2log, routes[2], cl).mean() <= theirs + 0.02


def test_a_heat_only_trace_plans_with_its_own_top_k(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An SGLang dump ingested with its model's shape (top-2 here) is planned without tokens, so the planner's
    expectation of nodes per token must take the trace's top_k, not PlannerConfig's default of 8: every plan the
    report makes (ours and the origins' re-plans) gets router_top_k 2."""
    torch = pytest.importorskip("torch")
    from r3trace.analysis.ingest import ModelShape
    from r3trace.analysis.ingest_dump import ingest_expert_distribution
    from r3trace.analysis.store import TraceStore
    from r3trace.eplb import planner
    from r3trace.eplb.plan_request import PlanRequest
    from r3trace.eplb.report import make_report

    rng = np.random.default_rng(2)
    counts = torch.from_numpy(rng.poisson(1000 / (1 + np.arange(32)), size=(2, 3, 32)))
    torch.save({"logical_count": counts}, tmp_path / "dump.pt")
    shape = ModelShape(num_hidden_layers=3, moe_layer_ids=(0, 1, 2), num_experts=32, top_k=2, num_groups=4)
    ingest_expert_distribution(tmp_path / "dump.pt", tmp_path / "store", shape, run_id="heat")
    seen: list[int] = []
    real = planner.plan

    def recorded(*args: object, **kwargs: object) -> object:
        seen.append(kwargs["cfg"].router_top_k)  # type: ignore[attr-defined]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(planner, "plan", recorded)
    rep = make_report(TraceStore(tmp_path / "store"), PlanRequest(Cluster(16, 4, 32, num_groups=4), policy="ours",
                                                                   run_id="heat"))
    assert rep.train_tokens is None and rep.top_k == 2 and seen and set(seen) == {2}
