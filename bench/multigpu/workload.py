"""The parallel matrix's workload: one set of requests holding what a layout can get wrong, run through any Engine,
and its bitwise comparison against a one-process run. tests/engine/test_parallel_exact.py (gloo ranks on the CPU)
and bench/multigpu (NCCL ranks on GPUs) both run it.

Cases, by name (routed_dp_rank pins only where there is more than one DP rank; PINS gives the rank of each request):
- spread: 5 requests round-robin over the DP ranks, one of 45 tokens (chunked prefill at 16 tokens a chunk);
- idle_rank: every request pinned to DP rank 0 (rank 1 runs idle forwards for the whole call);
- prefix: a 40-token prefix, then two requests sharing it, on the same DP rank (a cache hit) and on the other
  (no hit under DP: each DP rank has its own cache);
- idle_middle + stream: a long request streamed on DP rank 1 while rank 0 finishes a short one, idles, then gets
  another (a trace's forward ids show rank 0's idle forwards between the two);
- replay_free + replay: a free run's routes replayed swapped onto two prompts on both DP ranks, beside a free one;
- preempt: four requests on DP rank 0 that outgrow its KV pool (OPTIONS' 160 tokens): retractions, re-prefills.
fp32 samples/model; every request asks for logprobs (top-2), routes and their weights.
"""

from __future__ import annotations

import time
from typing import Any

import duckdb
import numpy as np

from r3trace.capture.wire import decode_routed_experts, decode_routed_weights

# kv_pool_tokens: each DP rank's pool; 160 makes the preempt case retract (4 requests of 30 + 20 tokens)
OPTIONS: dict[str, Any] = dict(deterministic=True, max_running_requests=8, kv_pool_tokens=160,
                               chunked_prefill_size=16, capture_weights=True)  # fmt: skip
ASK: dict[str, Any] = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=2, return_routed_experts=True,
                           return_routed_weights=True)  # fmt: skip
_RNG = np.random.default_rng(22)


def _prompt(n: int) -> list[int]:
    return _RNG.integers(2, 4000, n).tolist()


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


SPREAD = [_prompt(n) for n in (5, 12, 45, 24, 9)]
IDLE = [_prompt(n) for n in (7, 15, 11)]
PREFIX = _prompt(40)
SHARED = [PREFIX + _prompt(n) for n in (5, 6, 3)]
LONG, SHORT, LATER = _prompt(13), _prompt(6), _prompt(8)
REPLAY = [_prompt(9) for _ in range(3)]
PREEMPT = [_prompt(30) for _ in range(4)]
# each case's prompts and the DP rank each request runs on (when dp_size > 1), in result order
PROMPTS: dict[str, list[list[int]]] = {
    "spread": SPREAD, "idle_rank": IDLE, "prefix": SHARED, "idle_middle": [SHORT, LATER], "stream": [LONG],
    "replay_free": REPLAY[:2], "replay": [REPLAY[2], REPLAY[0], REPLAY[1]], "preempt": PREEMPT,
}  # fmt: skip
PINS: dict[str, list[int]] = {
    "spread": [0, 1, 0, 1, 0], "idle_rank": [0, 0, 0], "prefix": [1, 1, 0], "idle_middle": [0, 0], "stream": [1],
    "replay_free": [1, 0], "replay": [0, 1, 0], "preempt": [0, 0, 0, 0],
}  # fmt: skip
Results = dict[str, list[dict[str, Any]]]


def run_workload(engine: Any, dp_size: int, scheduler: Any = None, long_tokens: int = 40) -> Results:
    """Every case's results, by case. scheduler: the one-process engine's, to check that the preempt case retracts
    (on the ranks the same scheduler runs the same requests in a pool of the same size: DP rank 0 holds all four).
    long_tokens: LONG's tokens, which must outlast SHORT, the sleep and LATER (<= 100: LONG, SHORT and LATER then
    still fit one 160-token pool)."""

    def gen(prompts: list[list[int]], pins: list[int] | None, **kw: Any) -> list[dict[str, Any]]:
        dp_ranks = None if pins is None or dp_size == 1 else pins
        out = engine.generate(input_ids=prompts, routed_dp_rank=dp_ranks, **kw)
        errors = [o["error"] for o in out if "error" in o]
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(out)} requests failed: {errors[0]}")
        return out

    res: Results = {}
    res["spread"] = gen(SPREAD, None, sampling_params=greedy(6), **ASK)  # round robin: ranks 0, 1, 0, 1, 0
    res["idle_rank"] = gen(IDLE, PINS["idle_rank"], sampling_params=greedy(5), **ASK)
    # The cache hit stops before logprob_start_len - 1 (input logprobs need their logits): start after the prefix.
    past = {**ASK, "logprob_start_len": len(PREFIX) + 1}
    res["prefix"] = gen(SHARED[:1], [1], sampling_params=greedy(4), **ASK)
    res["prefix"] += gen(SHARED[1:2], [1], sampling_params=greedy(4), **past)
    res["prefix"] += gen(SHARED[2:], [0], sampling_params=greedy(4), **past)
    # idle_middle: LONG streams on rank 1 (submitted at once); SHORT runs and finishes on rank 0, which then idles
    # while LONG decodes, until LATER arrives there.
    stream = engine.generate(input_ids=LONG, sampling_params=greedy(long_tokens), stream=True,
                             routed_dp_rank=1 if dp_size > 1 else None, **ASK)  # fmt: skip
    res["idle_middle"] = gen([SHORT], [0], sampling_params=greedy(3), **ASK)
    # Rank 0 idles from the forward after SHORT's last: the ranks step on while SHORT's result travels. The sleep
    # adds a few idle forwards (a step is ~75 ms on 2 cores) and stays inside LONG's steps (40 on the CPU, more where
    # steps take a few ms).
    time.sleep(0.1)
    res["idle_middle"] += gen([LATER], [0], sampling_params=greedy(3), **ASK)
    res["stream"] = [joined(list(stream))]
    # replay: R0 and R1 run free; then R2 free beside R0 forced to R1's routes and R1 forced to R0's
    free = gen(REPLAY[:2], PINS["replay_free"], sampling_params=greedy(6), **ASK)
    forced = [None, free[1]["meta_info"]["routed_experts"], free[0]["meta_info"]["routed_experts"]]
    res["replay_free"] = free
    res["replay"] = gen(PROMPTS["replay"], PINS["replay"], sampling_params=greedy(6), routed_experts=forced, **ASK)
    before = scheduler.num_retractions if scheduler is not None else 0
    res["preempt"] = gen(PREEMPT, PINS["preempt"], sampling_params=greedy(20), **ASK)
    if scheduler is not None and scheduler.num_retractions == before:
        raise RuntimeError("the preempt case retracted nothing: the KV pool no longer forces it")
    return res


LISTS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs")


def joined(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chunks as one result: tokens, logprobs, routes and weights (decoded) concatenated."""
    meta = dict(chunks[-1]["meta_info"])
    for key in LISTS:
        meta[key] = [x for c in chunks for x in c["meta_info"].get(key, [])]
    parts = [c["meta_info"] for c in chunks if "routed_experts" in c["meta_info"]]
    return {"output_ids": [t for c in chunks for t in c["output_ids"]], "meta_info": meta,
            "routes": np.concatenate([decode_routed_experts(m) for m in parts]),
            "weights": np.concatenate([decode_routed_weights(m) for m in parts])}  # fmt: skip


def routes_of(out: dict[str, Any]) -> np.ndarray:
    """[rows, L, K] the routes of a result (or of a joined stream)."""
    return out["routes"] if "routes" in out else decode_routed_experts(out["meta_info"])


def weights_of(out: dict[str, Any]) -> np.ndarray:
    return out["weights"] if "weights" in out else decode_routed_weights(out["meta_info"])


def trace_problems(glob: str, res: Results, dp_size: int) -> list[str]:
    """A trace recorded over run_workload: one row set per (request, position, layer); dp_rank the rank each request
    ran on; rows = the returned routes; under DP, rank 0 idle between SHORT's last forward and LATER's first."""
    con = duckdb.connect()
    rows = f"read_parquet('{glob}')"
    out: list[str] = []
    (dup,) = con.execute(f"SELECT count(*) FROM (SELECT request_id, token_pos, layer_id, count(*) c FROM {rows} "
                         "GROUP BY ALL HAVING c > 1)").fetchone() or (0,)  # fmt: skip
    if dup:
        out.append(f"trace: {dup} (request, position, layer) keys hold more than one row")
    ranks = dict(con.execute(f"SELECT request_id, list(DISTINCT dp_rank) FROM {rows} GROUP BY 1").fetchall())
    moe = res["spread"][0]["meta_info"]["moe_layer_ids"]
    for case, outs in res.items():
        for o, rank in zip(outs, PINS[case], strict=True):
            rid = o["meta_info"]["id"]
            if ranks.get(rid) != [rank if dp_size > 1 else 0]:
                out.append(f"trace: {case} {rid} ran on DP ranks {ranks.get(rid)}, want {rank if dp_size > 1 else 0}")
            got = con.execute(f"SELECT token_pos, topk_ids FROM {rows} WHERE request_id = ? "
                              "ORDER BY token_pos, layer_id", [rid]).fetchall()  # fmt: skip
            want = routes_of(o)[:, moe]  # [n, M, K]: every computed position, cached prefix rows included
            if [p for p, _ in got[:: len(moe)]] != list(range(want.shape[0])):
                out.append(f"trace: {case} {rid}: positions are not 0..{want.shape[0] - 1} once each")
            elif not np.array_equal(np.array([t for _, t in got]).reshape(want.shape), want):
                out.append(f"trace: {case} {rid}: topk_ids differ from the returned routes")
    if dp_size > 1:
        def forwards(o: dict[str, Any]) -> list[int]:
            q = f"SELECT DISTINCT forward_id FROM {rows} WHERE request_id = ? ORDER BY 1"
            return [f for (f,) in con.execute(q, [o["meta_info"]["id"]]).fetchall()]

        short, later, long = (forwards(o) for o in (*res["idle_middle"], *res["stream"]))
        if not ([f for f in long if short[-1] < f < later[0]] and later[0] < long[-1]):
            out.append(f"trace: LONG's forwards {long} do not span SHORT {short} -> LATER {later}")
        (busy,) = con.execute(f"SELECT count(*) FROM {rows} WHERE dp_rank = 0 AND forward_id > ? AND forward_id < ?",
                              [short[-1], later[0]]).fetchone() or (0,)  # fmt: skip
        if busy:
            out.append(f"trace: rank 0 computed rows between forwards {short[-1]} and {later[0]}: not idle")
    return out
