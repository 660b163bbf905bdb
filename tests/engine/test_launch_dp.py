"""The launcher under DP attention (dp_size 2): requests on their DP rank, idle forwards, one trace row set each.

Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/engine/test_launch_dp.py

The DP-attention model path (engine/dp_layout.py's gather_dp_layout, the scattered communicators) is not in this
branch, so two things stand in for it, and only in the rank processes of this test:
- each rank builds the full one-process model (its forward has no collective of its own);
- ModelRunner's step_layout is replaced by one that stamps the DP rank and runs one all-reduce over the world per
  forward, as the DP layout's all-gather does. A rank that skipped a forward (no idle batch) would leave its
  peer's all-reduce waiting: the test fails on the collective timeout instead of passing.
Everything else is the product's: Engine (launcher "torchrun", so rank 0's loop runs beside the front end),
WorkerGroup, DpController, RankLoop, the trace writer. After the DP helper's merge, re-run this with the real
model path (drop both stand-ins) and compare against a one-process run.
"""

from __future__ import annotations

import pickle
import queue
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import duckdb
import torch
import torch.distributed as dist

from r3trace.engine import Engine, model_runner
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.engine_core import EngineCore
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.launch.config import LaunchConfig
from r3trace.engine.launch.group import WorkerGroup
from r3trace.engine.launch.lockstep import RankLoop
from r3trace.engine.launch.members import ThreadMember
from r3trace.engine.parallel import ParallelInfo
from tests.spawn import spawn_ranks

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "model"
OPTIONS: dict[str, Any] = dict(max_running_requests=8, kv_pool_tokens=2048, chunked_prefill_size=64)
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21], [22, 23, 24, 25]]
TIMEOUT = timedelta(seconds=30)


def _rank(rank: int, store: str, out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=TIMEOUT)
    forwards: list[tuple[int, int]] = []  # (forward_id, tokens) of every forward this rank ran

    def stand_in_layout(fb: ForwardBatch, parallel: ParallelInfo) -> ForwardBatch:
        fb.dp_rank = parallel.dp_rank
        forwards.append((fb.forward_id, fb.num_tokens))
        dist.all_reduce(torch.tensor([fb.num_tokens]))  # the layout's collective: every rank, every forward
        return fb

    model_runner.step_layout = stand_in_layout  # type: ignore[assignment]
    parallel = ParallelInfo(rank, 2, 2)  # DP attention layout: each rank its own DP group (attention TP 1)
    core = EngineCore(SAMPLE, EngineConfig(**OPTIONS), ParallelInfo(), threaded=False)  # the full model
    core.runner.parallel = parallel
    try:
        out: dict[str, Any] = {}
        if rank == 0:
            out = _front_end(core, parallel, out_dir)
        else:
            RankLoop(core, parallel, dist.group.WORLD).run()
        out["forwards"] = forwards
        (out_dir / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))
    finally:
        dist.destroy_process_group()


def _front_end(core: EngineCore, parallel: ParallelInfo, out_dir: Path) -> dict[str, Any]:
    inbox: queue.Queue[Any] = queue.Queue()
    outbox: queue.Queue[Any] = queue.Queue()
    loop = threading.Thread(target=RankLoop(core, parallel, dist.group.WORLD, inbox, outbox).run, daemon=True)

    def beside_rank0(model_path: Path, config: EngineConfig, launch: LaunchConfig) -> WorkerGroup:
        loop.start()  # the product's torchrun path, with this test's rank-0 core
        return WorkerGroup._started(WorkerGroup(launch, inbox, outbox, [ThreadMember(loop)]), 60)

    WorkerGroup.beside_rank0 = beside_rank0  # type: ignore[assignment,method-assign]
    engine = Engine(SAMPLE, tp_size=2, dp_size=2, launcher="torchrun", **OPTIONS)
    try:
        engine.start_trace(out_dir / "trace", run_id="dp2")
        spread = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_routed_experts=True)
        pinned = engine.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY, routed_dp_rank=1)  # rank 0 idles
        stream = list(engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, stream=True,  # type: ignore[arg-type]
                                      routed_dp_rank=0))
        manifest = engine.stop_trace()
        flushed = engine.flush_cache()
    finally:
        engine.shutdown()
    loop.join(30)
    return dict(spread=spread, pinned=pinned, stream=stream, manifest=manifest, flushed=flushed)


def test_dp2_launcher_assigns_idles_and_traces(tmp_path: Path) -> None:
    spawn_ranks(_rank, (str(tmp_path / "store"), tmp_path), 2)
    r0 = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    r1 = pickle.loads((tmp_path / "rank1.pkl").read_bytes())
    with Engine(SAMPLE, **OPTIONS) as ref:
        want = ref.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert isinstance(want, list)
    assert [o["output_ids"] for o in r0["spread"]] == [w["output_ids"] for w in want]
    assert [o["output_ids"] for o in r0["pinned"]] == [w["output_ids"] for w in want[:3]]
    assert sum((c["output_ids"] for c in r0["stream"]), []) == want[0]["output_ids"]
    assert r0["flushed"] is True and r0["manifest"]["parallel"] == {"tp_size": 2, "dp_size": 2, "ep_size": 1}
    # Lockstep: both ranks ran the same forwards (ids in step), rank 0's idle ones with 0 tokens.
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
