"""What a multi-turn routing replay pays when it cannot reuse the prefix cache (CPU, fp32).

Run:   .venv/bin/python -m bench.replay_prefix_cache --out bench/results/replay-prefix-cache-cpu.json
Smoke: .venv/bin/python -m bench.replay_prefix_cache --smoke   (one 16-token history, 4-token turns, one rep)

A two-turn conversation on samples/model: turn 1 routes freely with return_routed_experts (a rollout),
turn 2's prompt is turn 1's prompt + output + a new user message, and it replays turn 1's routes on those
rows (routed_experts_replay_start_len=0, a partial replay: the new message and the reply route freely).
Turn 2 is timed on an engine with the prefix cache and on one without it (what a replay that bypasses the
cache computes: every prompt token); between repetitions the cache is flushed and turn 1 rerun untimed.
Reported per history length: turn 2's prompt tokens, the tokens it took from the cache, its median CPU time
(process time of all threads: the machine these ran on is shared, and wall time swung 2x between identical
runs), and the largest logprob difference between the two engines (exactness of the reuse).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from r3trace import decode_routed_experts
from r3trace.engine import Engine

MODEL = Path(__file__).resolve().parents[1] / "samples" / "model"
VOCAB = 4096  # samples/model/config.json


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def turn2(engine: Engine, history: list[int], user: list[int], new1: int, new2: int) -> tuple[float, dict[str, Any]]:
    """Turn 1 untimed (a fresh cache), then turn 2 timed: (seconds, turn 2's result)."""
    assert engine.flush_cache()
    one = engine.generate(input_ids=history, sampling_params=greedy(new1), return_routed_experts=True)
    assert isinstance(one, dict)
    routes = decode_routed_experts(one["meta_info"])  # rows [0, len(history) + new1 - 1)
    prompt = history + one["output_ids"] + user
    t0 = time.process_time()  # CPU seconds of every thread: the scheduler thread's forwards included
    two = engine.generate(input_ids=prompt, sampling_params=greedy(new2), routed_experts=routes,
                          routed_experts_replay_start_len=0, return_logprob=True)  # input logprobs from 0 would
    # make the scheduler compute every prompt token (each one's logprob needs its logits)
    assert isinstance(two, dict)
    return time.process_time() - t0, two


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--history", default="128,384,768", help="turn 1 prompt lengths (tokens)")
    ap.add_argument("--new1", type=int, default=32, help="turn 1 output tokens")
    ap.add_argument("--user", type=int, default=32, help="turn 2's new user tokens")
    ap.add_argument("--new2", type=int, default=16, help="turn 2 output tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="one short conversation, one rep (make test)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.history, args.new1, args.user, args.new2, args.reps = "16", 4, 4, 2, 1
    rng = np.random.default_rng(0)
    convs = []
    for n in (int(x) for x in args.history.split(",")):
        convs.append((n, rng.integers(2, VOCAB, n).tolist(), rng.integers(2, VOCAB, args.user).tolist()))
    runs: dict[tuple[str, int], list[float]] = {}
    outs: dict[tuple[str, int], dict[str, Any]] = {}
    # One engine at a time (two idle engines side by side skewed each other's timings on 2 cores), a warm-up
    # conversation first, then every history length `reps` times.
    for name, options in (("cached", {}), ("bypass", {"enable_prefix_cache": False})):
        engine = Engine(args.model, **options)
        turn2(engine, *convs[0][1:], args.new1, args.new2)
        for _ in range(args.reps):
            for n, history, user in convs:
                seconds, outs[name, n] = turn2(engine, history, user, args.new1, args.new2)
                runs.setdefault((name, n), []).append(seconds)
        engine.shutdown()
    rows = []
    for n, _, _ in convs:
        a, b = outs["cached", n], outs["bypass", n]
        assert a["output_ids"] == b["output_ids"]

        def logprobs(r: dict[str, Any]) -> np.ndarray:
            m = r["meta_info"]
            return np.array([x[0] for x in m["input_token_logprobs"] + m["output_token_logprobs"]])

        row = {
            "history_tokens": n, "turn2_prompt_tokens": a["meta_info"]["prompt_tokens"],
            "reused_cached": a["meta_info"]["cached_tokens"], "reused_bypass": b["meta_info"]["cached_tokens"],
            "s_cached": statistics.median(runs["cached", n]), "s_bypass": statistics.median(runs["bypass", n]),
            "max_logprob_diff": float(np.abs(logprobs(a) - logprobs(b)).max()),
        }
        row["bypass_over_cached"] = row["s_bypass"] / row["s_cached"]
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        meta = {"model": args.model, "device": "cpu", "dtype": "float32", "new1": args.new1, "user": args.user,
                "new2": args.new2, "reps": args.reps}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
