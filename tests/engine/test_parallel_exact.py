"""Exact mode under DP attention and expert parallelism, bitwise against one process, through Engine.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/engine/test_parallel_exact.py  (-m slow: the tp4 ones)

One workload (`_workload`) runs on a one-process `Engine(deterministic=True)` and on each layout (dp2, ep2,
dp2+ep2: world size 2; tp4 dp2 and tp4 dp2 ep2, attention TP 2: world size 4, slow), one Engine per layout, a trace
recording throughout. It holds the cases of issue 22's matrix that a layout can get wrong:
- spread: 5 requests round-robin over the DP ranks, one of 45 tokens (chunked prefill at 16 tokens a chunk);
- idle_rank: every request pinned to DP rank 0 (rank 1 runs idle forwards for the whole call);
- prefix: a 40-token prefix, then two requests sharing it, on the same DP rank (a cache hit) and on the other
  (no hit under DP: each DP rank has its own cache);
- idle_middle: a long request streamed on DP rank 1 while rank 0 finishes a short one, idles, then gets another
  (the trace's forward ids show rank 0's idle forwards between the two); the stream's chunks joined equal the
  one-process non-stream result;
- replay: a free run's routes replayed swapped onto two prompts on both DP ranks, beside a free request;
- preempt: four requests on DP rank 0 that outgrow its KV pool: retractions and re-prefills.
Exact mode promises the same bits in any batch, chunking, cache state and layout, so every comparison is ==:
greedy tokens, input and output logprobs (top-2 too), routes (0 mismatched (token, layer) entries) and their
weights. fp32, samples/model. The trace holds one row set per (request, position, layer), stamped with the DP rank
the request ran on, equal to the routes returned.

A capturer that reads a DP rank's rows at [0, n) instead of its row range fails dp2 and tp4 dp2 (spread[1], the
first request on DP rank 1: 68 of 85 entries); under dp2+ep2 a rank's MoE rows do start at 0 (scattered tokens).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

from r3trace.capture.wire import decode_routed_experts, decode_routed_weights
from r3trace.engine import Engine

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "model"
# kv_pool_tokens: each DP rank's pool; 160 makes the preempt case retract (4 requests of 30 + 20 tokens)
OPTIONS: dict[str, Any] = dict(deterministic=True, max_running_requests=8, kv_pool_tokens=160,
                               chunked_prefill_size=16, capture_weights=True)
ASK: dict[str, Any] = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2, return_routed_experts=True,
                           return_routed_weights=True)
RNG = np.random.default_rng(22)


def _prompt(n: int) -> list[int]:
    return RNG.integers(2, 4000, n).tolist()


def _greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


SPREAD = [_prompt(n) for n in (5, 12, 45, 24, 9)]
IDLE = [_prompt(n) for n in (7, 15, 11)]
PREFIX = _prompt(40)
SHARED = [PREFIX + _prompt(n) for n in (5, 6, 3)]
LONG, SHORT, LATER = _prompt(13), _prompt(6), _prompt(8)
REPLAY = [_prompt(9) for _ in range(3)]
PREEMPT = [_prompt(30) for _ in range(4)]


def _workload(engine: Engine, dp_size: int, scheduler: Any = None) -> dict[str, list[dict[str, Any]]]:
    """Every case's results, by case; routed_dp_rank pins only where there is more than one DP rank. scheduler:
    the one-process engine's, to check that the preempt case retracts (on the ranks the same scheduler runs the
    same requests in a pool of the same size: DP rank 0 holds all four)."""

    def gen(prompts: list[list[int]], pins: list[int] | None, **kw: Any) -> list[dict[str, Any]]:
        dp_ranks = None if pins is None or dp_size == 1 else pins
        out = engine.generate(input_ids=prompts, routed_dp_rank=dp_ranks, **kw)
        assert isinstance(out, list) and not any("error" in o for o in out), out
        return out

    res: dict[str, list[dict[str, Any]]] = {}
    res["spread"] = gen(SPREAD, None, sampling_params=_greedy(6), **ASK)  # round robin: ranks 0, 1, 0, 1, 0
    res["idle_rank"] = gen(IDLE, [0, 0, 0], sampling_params=_greedy(5), **ASK)
    # The cache hit stops before logprob_start_len - 1 (input logprobs need their logits): start after the prefix.
    past = {**ASK, "logprob_start_len": len(PREFIX) + 1}
    res["prefix"] = gen(SHARED[:1], [1], sampling_params=_greedy(4), **ASK)
    res["prefix"] += gen(SHARED[1:2], [1], sampling_params=_greedy(4), **past)
    res["prefix"] += gen(SHARED[2:], [0], sampling_params=_greedy(4), **past)
    # idle_middle: LONG streams on rank 1 (submitted at once); SHORT runs and finishes on rank 0, which then idles
    # while LONG decodes, until LATER arrives there.
    stream = engine.generate(input_ids=LONG, sampling_params=_greedy(40), stream=True,
                             routed_dp_rank=1 if dp_size > 1 else None, **ASK)
    res["idle_middle"] = gen([SHORT], [0], sampling_params=_greedy(3), **ASK)
    # Rank 0 idles from the forward after SHORT's last: the ranks step on while SHORT's result travels. The sleep
    # adds a few idle forwards (a step is ~75 ms on 2 cores) and stays well inside LONG's 40 steps on a fast machine.
    time.sleep(0.1)
    res["idle_middle"] += gen([LATER], [0], sampling_params=_greedy(3), **ASK)
    res["stream"] = [_joined(list(stream))]  # type: ignore[arg-type]
    # replay: R0 and R1 run free; then R2 free beside R0 forced to R1's routes and R1 forced to R0's
    free = gen(REPLAY[:2], [1, 0], sampling_params=_greedy(6), **ASK)
    forced = [None, free[1]["meta_info"]["routed_experts"], free[0]["meta_info"]["routed_experts"]]
    res["replay_free"] = free
    res["replay"] = gen([REPLAY[2], REPLAY[0], REPLAY[1]], [0, 1, 0], sampling_params=_greedy(6),
                        routed_experts=forced, **ASK)
    before = scheduler.num_retractions if scheduler is not None else 0
    res["preempt"] = gen(PREEMPT, [0, 0, 0, 0], sampling_params=_greedy(20), **ASK)
    assert scheduler is None or scheduler.num_retractions > before, "the preempt case retracted nothing"
    return res


LISTS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs")


def _joined(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chunks as one result: tokens, logprobs, routes and weights (decoded) concatenated."""
    meta = dict(chunks[-1]["meta_info"])
    for key in LISTS:
        meta[key] = [x for c in chunks for x in c["meta_info"].get(key, [])]
    parts = [c["meta_info"] for c in chunks if "routed_experts" in c["meta_info"]]
    return {"output_ids": [t for c in chunks for t in c["output_ids"]], "meta_info": meta,
            "routes": np.concatenate([decode_routed_experts(m) for m in parts]),
            "weights": np.concatenate([decode_routed_weights(m) for m in parts])}


def _routes(out: dict[str, Any]) -> np.ndarray:
    return out["routes"] if "routes" in out else decode_routed_experts(out["meta_info"])


def _assert_same(case: str, want: dict[str, Any], got: dict[str, Any]) -> None:
    """Bitwise: tokens, input and output logprobs (== on floats; top-2 too), routes with 0 mismatched (token,
    layer) entries, their weights."""
    assert got["output_ids"] == want["output_ids"], case
    for key in LISTS[2:]:
        assert got["meta_info"][key] == want["meta_info"][key], (case, key)
    for key in LISTS[:2]:
        w, g = want["meta_info"][key], got["meta_info"][key]
        assert len(g) == len(w) > 0, (case, key, len(g), len(w))
        bad = [i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b]
        assert not bad, f"{case} {key}: {len(bad)} of {len(w)} differ, first at {bad[0]}: {w[bad[0]]} vs {g[bad[0]]}"
    a, b = _routes(want), _routes(got)
    assert a.shape == b.shape, (case, a.shape, b.shape)
    mismatched = int((a != b).any(axis=-1).sum())
    assert mismatched == 0, f"{case}: {mismatched} of {a.shape[0] * a.shape[1]} (token, layer) route entries differ"
    w, g = (o["weights"] if "weights" in o else decode_routed_weights(o["meta_info"]) for o in (want, got))
    assert w.shape == a.shape and np.array_equal(w, g, equal_nan=True), f"{case}: routed weights differ"


def _check_trace(glob: str, res: dict[str, list[dict[str, Any]]], dp_size: int) -> None:
    """One row set per (request, position, layer); dp_rank the rank each request ran on; rows = returned routes."""
    con = duckdb.connect()
    rows = f"read_parquet('{glob}')"
    dup = con.execute(f"SELECT count(*) FROM (SELECT request_id, token_pos, layer_id, count(*) c FROM {rows} "
                      "GROUP BY ALL HAVING c > 1)").fetchone()
    assert dup == (0,)
    pins = {"spread": [0, 1, 0, 1, 0], "idle_rank": [0, 0, 0], "prefix": [1, 1, 0], "idle_middle": [0, 0],
            "stream": [1], "replay_free": [1, 0], "replay": [0, 1, 0], "preempt": [0, 0, 0, 0]}
    ranks = dict(con.execute(f"SELECT request_id, list(DISTINCT dp_rank) FROM {rows} GROUP BY 1").fetchall())
    moe = res["spread"][0]["meta_info"]["moe_layer_ids"]
    for case, outs in res.items():
        for o, rank in zip(outs, pins[case], strict=True):
            rid = o["meta_info"]["id"]
            assert ranks[rid] == [rank if dp_size > 1 else 0], (case, rid, ranks[rid])
            got = con.execute(f"SELECT token_pos, topk_ids FROM {rows} WHERE request_id = ? "
                              "ORDER BY token_pos, layer_id", [rid]).fetchall()
            want = _routes(o)[:, moe]  # [n, M, K]: every computed position, cached prefix rows included
            assert [p for p, _ in got[:: len(moe)]] == list(range(want.shape[0])), (case, rid)
            np.testing.assert_array_equal(np.array([t for _, t in got]).reshape(want.shape), want, err_msg=case)
    if dp_size > 1:  # rank 0 idled between SHORT's last forward and LATER's first while LONG ran on rank 1
        def forwards(out: dict[str, Any]) -> list[int]:
            q = f"SELECT DISTINCT forward_id FROM {rows} WHERE request_id = ? ORDER BY 1"
            return [f for (f,) in con.execute(q, [out["meta_info"]["id"]]).fetchall()]

        short, later, long = (forwards(o) for o in (*res["idle_middle"], *res["stream"]))
        assert [f for f in long if short[-1] < f < later[0]] and later[0] < long[-1], (short, later, long)
        busy0 = con.execute(f"SELECT count(*) FROM {rows} WHERE dp_rank = 0 AND forward_id > ? AND forward_id < ?",
                            [short[-1], later[0]]).fetchone()
        assert busy0 == (0,), f"rank 0 computed rows between forwards {short[-1]} and {later[0]}: not idle"


@pytest.fixture(scope="module")
def reference() -> dict[str, list[dict[str, Any]]]:
    with Engine(SAMPLE, **OPTIONS) as ref:
        res = _workload(ref, dp_size=1, scheduler=ref.scheduler)
        whole = ref.generate(input_ids=LONG, sampling_params=_greedy(40), **ASK)
    _assert_same("stream against non-stream", whole, res["stream"][0])  # type: ignore[arg-type]
    return res


LAYOUTS = [
    pytest.param(2, 2, 1, id="dp2"),
    pytest.param(2, 1, 2, id="ep2"),
    pytest.param(2, 2, 2, id="dp2_ep2"),
    pytest.param(4, 2, 1, id="tp4_dp2", marks=pytest.mark.slow),  # attention TP 2, the MoE tensor-parallel
    pytest.param(4, 2, 2, id="tp4_dp2_ep2", marks=pytest.mark.slow),  # attention TP 2: routes all-gathered
]


@pytest.mark.parametrize(("tp", "dp", "ep"), LAYOUTS)
def test_layout_is_bitwise_one_process(
    reference: dict[str, list[dict[str, Any]]], tmp_path: Path, tp: int, dp: int, ep: int
) -> None:
    with Engine(SAMPLE, tp_size=tp, dp_size=dp, ep_size=ep, **OPTIONS) as engine:
        engine.start_trace(tmp_path / "trace", run_id="matrix")
        got = _workload(engine, dp_size=dp)
        manifest = engine.stop_trace()
    assert manifest is not None and manifest["parallel"] == {"tp_size": tp, "dp_size": dp, "ep_size": ep}
    for case, outs in reference.items():
        for i, (w, g) in enumerate(zip(outs, got[case], strict=True)):
            _assert_same(f"{case}[{i}]", w, g)
    # the prefix-cache hit is on the request's own DP rank only
    assert [o["meta_info"]["cached_tokens"] for o in got["prefix"]] == [0, 40, 0 if dp > 1 else 40]
    # replay: the returned routes are the forced ones, and forcing R1's routes onto R0 changed its logprobs
    free, replay = got["replay_free"], got["replay"]
    np.testing.assert_array_equal(_routes(replay[1]), _routes(free[1]))
    np.testing.assert_array_equal(_routes(replay[2]), _routes(free[0]))
    assert replay[1]["meta_info"]["input_token_logprobs"][1:] != free[0]["meta_info"]["input_token_logprobs"][1:]
    _check_trace(str(tmp_path / "trace" / "routes" / "**" / "part-*.parquet"), got, dp)
