"""The torchrun launch path under DP attention (dp_size 2): requests on their DP rank, idle forwards, one trace row
set each, and results bitwise equal to one process (exact mode).

Run: TRITON_INTERPRET=1 .venv/bin/pytest -q tests/engine/test_launch_dp.py

Two processes started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT: the env://
rendezvous), each running what `-m r3trace.engine.launch` runs: world rank 0 an Engine with launcher="torchrun"
(its rank-0 loop in a thread beside the front end), rank 1 run_rank. Everything is the product's: the DP-attention
model path, WorkerGroup, DpController, RankLoop, the trace writer. The one addition is a spy around ModelRunner's
step_layout that records (forward_id, tokens) of every forward a rank runs and then calls the real one: it shows
the ranks in lockstep, idle forwards included.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import duckdb
import torch

from bench.spawn import free_port, spawn_ranks
from r3trace.engine import Engine, model_runner
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.launch.config import LaunchConfig
from r3trace.engine.launch.worker import WorkerSpec, run_rank
from r3trace.engine.parallel import ParallelInfo

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "model"
OPTIONS: dict[str, Any] = dict(deterministic=True, max_running_requests=8, kv_pool_tokens=2048, chunked_prefill_size=64)
ASK: dict[str, Any] = dict(return_logprob=True, logprob_start_len=0, return_routed_experts=True)
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21], [22, 23, 24, 25]]



def _rank(rank: int, port: int, out_dir: Path) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    forwards: list[tuple[int, int]] = []  # (forward_id, tokens) of every forward this rank ran
    real = model_runner.step_layout

    def spy(fb: ForwardBatch, parallel: ParallelInfo) -> ForwardBatch:
        forwards.append((fb.forward_id, fb.num_tokens))
        return real(fb, parallel)

    model_runner.step_layout = spy  # type: ignore[assignment]
    out: dict[str, Any] = {}
    if rank == 0:
        out = _front_end(out_dir)
    else:
        run_rank(WorkerSpec(SAMPLE, EngineConfig(**OPTIONS), LaunchConfig(2, 2, 1, launcher="torchrun"), "env://"), 1)
    out["forwards"] = forwards
    (out_dir / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))


def _front_end(out_dir: Path) -> dict[str, Any]:
    with Engine(SAMPLE, tp_size=2, dp_size=2, launcher="torchrun", **OPTIONS) as engine:
        engine.start_trace(out_dir / "trace", run_id="dp2")
        spread = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, **ASK)
        pinned = engine.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY, routed_dp_rank=1, **ASK)  # 0 idles
        stream = list(engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True,  # type: ignore[arg-type]
                                      routed_dp_rank=0, return_routed_experts=True))
        manifest = engine.stop_trace()
        flushed = engine.flush_cache()
    return dict(spread=spread, pinned=pinned, stream=stream, manifest=manifest, flushed=flushed)


def _view(out: dict[str, Any]) -> tuple[Any, ...]:
    m = out["meta_info"]
    return out["output_ids"], m["input_token_logprobs"], m["output_token_logprobs"], m["routed_experts"]


def test_dp2_torchrun_is_one_process_assigns_idles_and_traces(tmp_path: Path) -> None:
    spawn_ranks(_rank, (free_port(), tmp_path), 2)
    r0 = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    r1 = pickle.loads((tmp_path / "rank1.pkl").read_bytes())
    with Engine(SAMPLE, **OPTIONS) as ref:
        want = ref.generate(input_ids=PROMPTS, sampling_params=GREEDY, **ASK)
    assert isinstance(want, list)
    # exact mode: tokens, input and output logprobs and routes the same bits as one process
    assert [_view(o) for o in r0["spread"]] == [_view(w) for w in want]
    assert [_view(o) for o in r0["pinned"]] == [_view(w) for w in want[:3]]
    assert sum((c["output_ids"] for c in r0["stream"]), []) == want[0]["output_ids"]
    assert r0["flushed"] is True and r0["manifest"]["parallel"] == {"tp_size": 2, "dp_size": 2, "ep_size": 1}
    # Lockstep: both ranks ran the same forwards (ids in step), each some idle ones with 0 tokens.
    assert [f for f, _ in r0["forwards"]] == [f for f, _ in r1["forwards"]]
    assert any(n == 0 for _, n in r0["forwards"]) and any(n == 0 for _, n in r1["forwards"])
    con = duckdb.connect()
    glob = f"{tmp_path}/trace/routes/**/part-*.parquet"
    dup = con.execute(f"SELECT count(*) FROM (SELECT request_id, token_pos, layer_id, count(*) c "
                      f"FROM read_parquet('{glob}') GROUP BY ALL HAVING c > 1)").fetchone()
    assert dup == (0,)
    ranks = dict(con.execute(f"SELECT request_id, min(dp_rank) * 10 + max(dp_rank) FROM read_parquet('{glob}') "
                             "GROUP BY 1").fetchall())
    # round robin: request i on DP rank i % 2; the pinned ones on 1; the stream on 0 (min == max: one rank each)
    assert [ranks[o["meta_info"]["id"]] for o in r0["spread"]] == [0, 11, 0, 11, 0, 11]
    assert [ranks[o["meta_info"]["id"]] for o in r0["pinned"]] == [11] * 3
    assert ranks[r0["stream"][0]["meta_info"]["id"]] == 0
    rows = dict(con.execute(f"SELECT request_id, count(*) FROM read_parquet('{glob}') GROUP BY 1").fetchall())
    moe = len(r0["manifest"]["moe_layer_ids"])
    for p, o in zip(PROMPTS, r0["spread"], strict=True):
        assert rows[o["meta_info"]["id"]] == (len(p) + GREEDY["max_new_tokens"] - 1) * moe
