"""A trace writer in a child process, stopped at a random moment, and the durability contract checked after.

The child (CHILD below) records synthetic requests through TraceWriter the way the engine does: several
requests in flight at once, each appending its tokens over several forwards, then `add_request`. After
`add_request` returns it appends "rid finish_time" to a log with one os.write (in the kernel before the next
line runs, so a kill never loses a logged line). Every id is a function of the request's seed, so the
parent can check values, not just counts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq

from r3trace.trace import Manifest, open_dataset, recover_run

REPO = Path(__file__).resolve().parents[2]
MOE = (1, 2, 3)  # MoE layers of a 4-layer model
E, K = 16, 2

CHILD = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from r3trace.trace import TraceWriter

    cfg = json.loads(sys.argv[1])
    moe, E, K = tuple(cfg["moe"]), cfg["E"], cfg["K"]

    def ids_of(i, n):  # [n, L, K] distinct ids per row, a function of the request index only
        base = np.random.default_rng(i).integers(0, E, size=(n, len(moe), 1))
        return ((base + np.arange(K)) % E).astype(np.int32)

    w = TraceWriter(cfg["root"], model_name="t", num_hidden_layers=4, moe_layer_ids=moe, num_experts=E, top_k=K,
                    run_id="k", rows_per_file=cfg["rows_per_file"], flush_interval_s=cfg["flush_interval_s"],
                    fsync=cfg["fsync"], small_file_rows=cfg["small_file_rows"], compact_fanin=cfg["fanin"])
    log = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    rng = np.random.default_rng(cfg["seed"])
    live, nxt, fwd = [], 0, 0
    os.write(log, b"ready\\n")
    while True:  # until stopped
        while len(live) < cfg["concurrency"]:
            live.append([nxt, int(rng.integers(1, cfg["max_tokens"] + 1)), 0])
            nxt += 1
        for req in list(live):
            i, n, done = req
            step = min(n - done, int(rng.integers(1, 6)))
            w.append_tokens("r%d" % i, np.arange(done, done + step), "decode", "computed", fwd, time.time_ns(), 0,
                            ids_of(i, n)[done:done + step])
            req[2] += step
            if req[2] == n:
                w.add_request("r%d" % i, prompt_tokens=n, completion_tokens=0, finish_reason="length")
                os.write(log, ("r%d %d %.6f\\n" % (i, n, time.time())).encode())
                live.remove(req)
        fwd += 1
        time.sleep(cfg["step_s"])
""")


def expected_ids(i: int, n: int) -> np.ndarray:
    base = np.random.default_rng(i).integers(0, E, size=(n, len(MOE), 1))
    return ((base + np.arange(K)) % E).astype(np.int32)


@dataclass(frozen=True)
class KillCase:
    seed: int
    sig: int
    after_s: float  # when the signal is sent, after the child said "ready"
    flush_interval_s: float
    rows_per_file: int
    small_file_rows: int
    fanin: int
    concurrency: int
    max_tokens: int
    step_s: float
    fsync: bool

    @classmethod
    def draw(cls, seed: int, sig: int) -> KillCase:
        rng = np.random.default_rng(seed)
        return cls(
            seed=seed, sig=sig, after_s=float(rng.uniform(0.8, 2.5)), flush_interval_s=float(rng.choice([0.4, 1.0])),
            rows_per_file=int(rng.choice([2048, 20_000, 1_000_000])), small_file_rows=int(rng.choice([60, 10_000])),
            fanin=int(rng.choice([2, 4, 8])), concurrency=int(rng.integers(1, 8)), max_tokens=int(rng.integers(1, 40)),
            step_s=float(rng.choice([0.0, 0.002, 0.01])), fsync=bool(rng.integers(0, 2)),
        )


def run_case(case: KillCase, tmp: Path) -> dict[str, object]:
    """Start the child, signal it `after_s` after it is ready, check the contract; returns what was seen."""
    root, log = tmp / "store", tmp / "finished.log"
    cfg = {"root": str(root), "log": str(log), "moe": MOE, "E": E, "K": K, "seed": case.seed,
           "rows_per_file": case.rows_per_file, "flush_interval_s": case.flush_interval_s, "fsync": case.fsync,
           "small_file_rows": case.small_file_rows, "fanin": case.fanin, "concurrency": case.concurrency,
           "max_tokens": case.max_tokens, "step_s": case.step_s}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], env=env, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not (log.exists() and log.read_bytes().startswith(b"ready")):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.01)
    time.sleep(case.after_s)
    killed_at = time.time()
    proc.send_signal(case.sig)
    _, err = proc.communicate(timeout=60)
    finished = {}
    for line in log.read_text().splitlines()[1:]:
        rid, n, t = line.split()
        finished[rid] = (int(n), float(t))
    return check_contract(root / "run_id=k", finished, killed_at, case, err.decode())


def check_contract(run_dir: Path, finished: dict[str, tuple[int, float]], killed_at: float, case: KillCase,
                   stderr: str) -> dict[str, object]:
    graceful = case.sig != signal.SIGKILL
    m = Manifest.read(run_dir)
    run = open_dataset(run_dir.parent)[0]
    assert run.state == ("closed" if graceful else "crashed"), (run.state, stderr)
    # every listed file is whole: its footer says the row count the manifest says
    for f in m.files:
        if f.name:
            assert pq.read_metadata(run.table_dir("routes") / f.name).num_rows == f.rows
        for table, extra in (("rollups", f.rollup), ("requests", f.requests)):
            assert extra is None or (run.table_dir(table) / extra).exists()
    assert m.rows == sum(f.rows for f in m.files)
    con = duckdb.connect()
    routes = [str(p) for p in run.route_files]
    reqs = [str(p) for p in run.request_files]
    committed = dict(con.sql(f"SELECT request_id, finish_reason FROM read_parquet({reqs})").fetchall() if reqs else [])
    rows = con.sql(f"SELECT request_id, token_pos, layer_id, topk_ids FROM read_parquet({routes}) "
                   "ORDER BY request_id, token_pos, layer_id").fetchall() if routes else []
    by_req: dict[str, list[tuple]] = {}
    for r in rows:
        by_req.setdefault(r[0], []).append(r)
    # kill -9 loses at most the requests that finished in the last flush_interval_s; a graceful stop loses none
    horizon = killed_at if graceful else killed_at - case.flush_interval_s
    must = {rid for rid, (_, t) in finished.items() if t <= horizon}
    missing = sorted(must - {r for r, why in committed.items() if why == "length"})
    if missing:  # how far before the horizon they finished: a commit late by a few ms under load, or a real loss
        late = [horizon - finished[rid][1] for rid in missing]
        newest = max((t for rid, (_, t) in finished.items() if rid in committed), default=None)
        assert not missing, (f"{len(missing)} finished requests lost, e.g. {missing[:3]}, finished {min(late):.3f}-"
                             f"{max(late):.3f} s before the horizon (kill - flush_interval_s); the newest committed "
                             f"one finished {'-' if newest is None else f'{killed_at - newest:.3f} s'} before the "
                             f"kill ({case})")
    # the child logs a request right after add_request returns, so a stop (or the flusher's commit before a kill) can
    # fall between the two: at most one request is committed as finished without a log line; its rows are checked
    # as those of its committed length
    unlogged = [rid for rid, why in committed.items() if why == "length" and rid not in finished]
    assert len(unlogged) <= 1, f"{unlogged[:3]} committed as finished but never logged ({case})"
    for rid, why in committed.items():  # a committed request has every row, with the values it was given
        if why != "length":
            continue
        got = np.array([r[3] for r in by_req.get(rid, [])], np.int32).reshape(-1, len(MOE), K)
        n = finished[rid][0] if rid in finished else len(got)
        assert len(got) > 0 or n == 0, rid
        np.testing.assert_array_equal(got, expected_ids(int(rid[1:]), n), err_msg=rid)
    # rows of requests that did not finish are visible only with the request marked unfinished
    unfinished = {rid for rid, why in committed.items() if why == "unfinished"} | set(
        r["request_id"] for r in run.unfinished_requests())
    orphans = set(by_req) - set(committed) - unfinished
    assert not orphans, f"rows of {sorted(orphans)[:3]} have no request row and are not marked unfinished"
    if reqs:
        sql = f"SELECT count(*), count(DISTINCT request_id) FROM read_parquet({reqs})"
        n, distinct = con.execute(sql).fetchall()[0]
        assert n == distinct, "a request has two rows in the requests table"
    if not graceful:
        after = recover_run(run_dir)
        again = open_dataset(run_dir.parent)[0]
        folders = [run_dir, *(again.table_dir(t) for t in ("routes", "rollups", "requests"))]
        on_disk = [p for d in folders if d.is_dir() for p in d.iterdir() if p.name != ".writer.lock"]
        assert after.status == "closed" and not [p for p in on_disk if p.name.endswith(".tmp")]
        listed = {*again.route_files, *again.rollup_files, *again.request_files}
        assert {p for p in on_disk if p.suffix == ".parquet"} == listed
        assert again.state == "closed"
        reqs2 = [str(p) for p in again.request_files]
        marked = dict(con.sql(f"SELECT request_id, finish_reason FROM read_parquet({reqs2})").fetchall())
        assert set(by_req) <= set(marked), "after recovery every request with rows has a request row"
    return {"committed": len(committed), "finished": len(finished), "must": len(must), "files": len(m.files),
            "unfinished": len(unfinished)}
