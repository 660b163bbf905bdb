"""Where SGLang's static dispatch sends a trace's tokens from (r3trace/eplb/static.py, token_sources) and the
`r3trace eplb` report that uses it: with DP attention each rank dispatches its own tokens, so a trace whose ranks
favour different experts loads the replicas unlike token t from rank t mod G.

The held-out static figure is recomputed here pair by pair with the engine's static_choice (engine/layers/
expert_map.py, the map the engine dispatches by; tests/analysis/test_eplb_static.py ties it to SGLang's
compute_logical_to_rank_dispatch_physical_map at sgl-project/sglang@01fec5c) from the rows written, not through
static_gpu_load.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from r3trace.analysis.store import TraceStore
from r3trace.engine.layers.expert_location import ExpertLocation
from r3trace.engine.layers.expert_map import static_choice
from r3trace.eplb import Cluster
from r3trace.eplb.backtest import backtest
from r3trace.eplb.evaluate import plan_policy
from r3trace.eplb.plan_request import PlanRequest
from r3trace.eplb.report import make_report
from r3trace.eplb.score import balancedness, heat_of
from r3trace.eplb.static import static_gpu_load, token_sources
from r3trace.eplb.window import WindowSpec
from r3trace.trace import TraceWriter

L_IDS, E, K, G = (0, 2), 16, 2, 4
T0 = 1_767_225_600 * 10**9  # a whole second: rollup windows start on it
TOKENS, SECONDS = 1600, 8


def test_sources_by_hand() -> None:
    # 2 DP groups on 4 GPUs: group 0 owns ranks 0-1, group 1 ranks 2-3; each group's tokens go out in turn
    got = token_sources(np.array([0, 1, 0, 1, 1, 0]), None, 4)
    assert got.rank is not None and got.rank.tolist() == [0, 2, 1, 3, 2, 0]
    # DP attention on every rank: each token from its own rank
    got = token_sources(np.array([3, 1, 2, 0, 3]), 4, 4)
    assert got.rank is not None and got.rank.tolist() == [3, 1, 2, 0, 3]
    # the manifest's dp_size wins over the ranks seen (rank 3 idle in the sample): groups of one rank
    got = token_sources(np.array([0, 2, 1]), 4, 8)
    assert got.rank is not None and got.rank.tolist() == [0, 4, 2]


@pytest.mark.parametrize("ranks, dp_size, why", [(np.zeros(5, np.int64), None, "one DP rank"),
                                                 (np.array([0, 1, 2]), None, "3 DP ranks do not divide 4"),
                                                 (np.array([0, 5]), 4, "4 DP ranks do not divide 4"),
                                                 (None, None, "")])
def test_sources_fall_back_to_round_robin(ranks: np.ndarray | None, dp_size: int | None, why: str) -> None:
    got = token_sources(ranks, dp_size, 4)
    assert got.rank is None and got.how.startswith("token t from rank t mod 4") and why in got.how


def rank_routes(rng: np.random.Generator, t: int) -> tuple[np.ndarray, np.ndarray]:
    """[T, L, K] distinct ids and [T] dp_rank: rank r's requests favour experts 4r .. 4r + 3 (a DP rank serves
    its own users), so where a token comes from decides which replica static dispatch loads."""
    rank = rng.integers(0, G, t)
    ids = np.empty((t, len(L_IDS), K), dtype=np.int64)
    for i in range(t):
        p = np.ones(E)
        p[4 * rank[i]:4 * rank[i] + 4] = 20.0
        for li in range(len(L_IDS)):
            ids[i, li] = rng.choice(E, K, replace=False, p=p / p.sum())
    return ids, rank


def test_report_sends_tokens_from_their_dp_rank(tmp_path: Path) -> None:
    ids, rank = rank_routes(np.random.default_rng(3), TOKENS)
    ts = T0 + (np.arange(TOKENS) * SECONDS * 10**9) // TOKENS
    with TraceWriter(tmp_path, model_name="m", num_hidden_layers=3, moe_layer_ids=L_IDS, num_experts=E, top_k=K,
                     run_id="dp", rows_per_file=400, parallel={"tp_size": G, "dp_size": G, "ep_size": G}) as w:
        w.append_tokens([f"r{i % 7}" for i in range(TOKENS)], np.arange(TOKENS), "decode", "computed",
                        np.arange(TOKENS) // 8, ts, rank, ids)
    cl = Cluster(G, 1, 24)
    held = ts >= T0 + 6 * 10**9  # --eval time=6.. (the first 400 of those tokens are replayed)
    req = PlanRequest(cl, policy="global", held_out=WindowSpec("time", 6.0, None), run_id="dp", replay_tokens=400)
    rep = make_report(TraceStore(tmp_path), req)
    assert rep.held is not None and rep.held.static is not None
    assert rep.static_sources == "each token from its DP rank (4 DP ranks on 4 GPUs)"
    # pair by pair: the engine's static map of the plan for each token's own rank
    phy, slots_per_gpu = rep.placement.phy2log, 24 // G
    loc = ExpertLocation.from_physical_to_logical(phy, E, G, tuple(range(len(L_IDS))))
    sent = ids[held][:400]
    want, rr = np.zeros((len(L_IDS), G)), np.zeros((len(L_IDS), G))
    for layer in range(len(L_IDS)):
        maps = [static_choice(loc, layer, r).numpy() for r in range(G)]
        for i, (row, r) in enumerate(zip(sent[:, layer], rank[held][:400], strict=True)):
            for x in row:
                want[layer, maps[r][x] // slots_per_gpu] += 1
                rr[layer, maps[i % G][x] // slots_per_gpu] += 1  # the round-robin rule, for contrast
    bal = float((want.mean(1) / want.max(1)).mean())
    assert rep.held.balancedness_static == pytest.approx(bal, abs=1e-12)
    # the rank matters here: the round-robin figure is another number (the test would pass without ranks otherwise)
    assert abs(float((rr.mean(1) / rr.max(1)).mean()) - bal) > 0.03, (bal, rr)


def test_backtest_folds_send_from_their_ranks() -> None:
    # auto's backtest judges static dispatch with each fold's own ranks (report._backtest passes them)
    ids, rank = rank_routes(np.random.default_rng(4), 800)
    history = np.stack([heat_of(ids[200 * w:200 * w + 200], E) for w in range(4)])
    held, cl = [2, 3], Cluster(G, 1, 24)
    fit = [ids[:200 * t] for t in held]
    vt, vr = [ids[200 * t:200 * t + 200] for t in held], [rank[200 * t:200 * t + 200] for t in held]
    got = backtest(history, held, fit, vt, cl, ("global",), ("mean",), "static", vr)[0]
    plain = backtest(history, held, fit, vt, cl, ("global",), ("mean",), "static")[0]
    for i, t in enumerate(held):
        pl = plan_policy("global", history[:t], "mean", cl, fit[i], dispatch="static")
        want = balancedness(static_gpu_load(pl, vt[i], cl, vr[i]))
        assert got.folds[i].balancedness_static == pytest.approx(want, abs=1e-12)
        assert abs(plain.folds[i].balancedness_static - want) > 0.03
