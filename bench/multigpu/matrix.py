"""Run the parallel matrix's cases (cases.py) against the one-process runs of the same workload (workload.py).

The references run in this process: exact mode once (the workload, and the rebalance case's requests), default
mode once, and for default mode a one-process model whose forwards give the near-tie gaps. Each case is then one
Engine of its layout with a trace recording: its ranks' environments checked (env.py), the workload compared
(compare.py), the trace checked, and for redundant experts the physical ids and the rebalance. One record per case.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.multigpu.cases import Case
from bench.multigpu.compare import NEAR_TIE, default_diff, exact_diff
from bench.multigpu.env import multicast_missing
from bench.multigpu.placement import physical_mismatches, plain_run, rebalance_prompts, rebalance_run, write_placement
from bench.multigpu.throughput import TRITON
from bench.multigpu.workload import OPTIONS, Results, run_workload, trace_problems
from r3trace.engine import Engine


@dataclass(frozen=True)
class MatrixConfig:
    model: Path
    device: str
    dtype: str = "float32"
    default_backend: str = "ref"  # default mode's backends: triton on a GPU (what serving runs), ref on the CPU
    near_tie: float = NEAR_TIE
    rebalance_tokens: int = 24  # each rebalance request's tokens: the update's chunks must land while they run
    long_tokens: int = 40  # the workload's LONG stream: it must outlast SHORT, a 0.1 s sleep and LATER
    tmp: Path = Path("/tmp")

    def options(self, case_mode: str) -> dict[str, Any]:
        opts: dict[str, Any] = {**OPTIONS, "dtype": self.dtype, "device": self.device}
        if case_mode == "default":
            opts["deterministic"] = False
            if self.default_backend == "triton":
                opts |= TRITON
        return opts


@dataclass
class References:
    exact: Results | None = None
    rebalance: list[dict[str, Any]] | None = None
    default: Results | None = None
    gaps: Callable[[list[int]], np.ndarray] | None = None
    records: list[dict[str, Any]] = field(default_factory=list)  # per mode: pass or error, seconds


def references(cfg: MatrixConfig, modes: set[str]) -> References:
    """The one-process runs the cases compare against (only the modes some case needs). A reference that fails is
    recorded (its cases then fail with its error); on a one-GPU machine these records are the whole matrix."""
    refs = References()
    for mode in sorted(modes):
        t0 = time.perf_counter()
        rec: dict[str, Any] = {"reference": f"{mode}/1gpu", "status": "pass"}
        try:
            with Engine(cfg.model, **cfg.options(mode)) as ref:
                res = run_workload(ref, dp_size=1, scheduler=ref.scheduler, long_tokens=cfg.long_tokens)
                if mode == "exact":
                    refs.exact, refs.rebalance = res, plain_run(ref, rebalance_prompts(), cfg.rebalance_tokens)
                else:
                    refs.default, refs.gaps = res, _gap_model(cfg)
            rec["requests"] = sum(len(v) for v in res.values())
        except Exception as exc:  # the cases of this mode report it
            rec |= {"status": "error", "problems": [f"{type(exc).__name__}: {exc}"],
                    "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
            print(f"[matrix] {mode} reference failed:\n{rec['traceback'][-1500:]}", flush=True)
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        refs.records.append(rec)
    return refs


def _gap_model(cfg: MatrixConfig) -> Callable[[list[int]], np.ndarray]:
    """sequence -> [T, L] order gaps of a one-process forward (ref backends), memoised: the default cases compare
    the same sequences."""
    from r3trace.capture.recorder import ListRecorder
    from r3trace.engine.engine_config import EngineConfig
    from r3trace.engine.model import build_model
    from r3trace.engine.model_config import ModelConfig
    from r3trace.engine.near_tie import sequence_gaps
    from r3trace.engine.parallel import ParallelInfo
    from r3trace.engine.weights import load_weights

    ecfg = EngineConfig(dtype=cfg.dtype, device=cfg.device)  # type: ignore[arg-type]
    model = build_model(ModelConfig.from_hf(cfg.model), ecfg, ParallelInfo(), ListRecorder())
    load_weights(model, cfg.model)
    memo: dict[tuple[int, ...], np.ndarray] = {}

    def gaps(seq: list[int]) -> np.ndarray:
        key = tuple(seq)
        if key not in memo:
            memo[key] = sequence_gaps(model, seq)
        return memo[key]

    return gaps


def run_case(case: Case, cfg: MatrixConfig, refs: References) -> dict[str, Any]:
    """One case's record: status pass / fail / error, the counts, the first problems."""
    rec: dict[str, Any] = {"case": case.name, "gpus": case.gpus, "mode": case.mode, **case.layout.engine_kwargs(),
                           "dispatch": case.dispatch, "rebalance": case.rebalance}  # fmt: skip
    t0 = time.perf_counter()
    problems: list[str] = []
    try:
        if (refs.exact if case.mode == "exact" else refs.default) is None:
            raise RuntimeError(f"no one-process {case.mode} reference: {[r.get('problems') for r in refs.records]}")
        work = cfg.tmp / case.name.replace("/", "-").replace("+", "-")
        with Engine(cfg.model, **case.layout.engine_kwargs(), **cfg.options(case.mode), **case.engine_options()
                    ) as engine:  # fmt: skip
            rec["start_s"] = round(time.perf_counter() - t0, 1)
            missing = multicast_missing(engine)
            rec["multicast_env_missing"] = missing
            problems += [f"multicast setting missing in {m}" for m in missing]
            engine.start_trace(work / "trace", run_id="matrix")
            got = run_workload(engine, dp_size=case.layout.dp, long_tokens=cfg.long_tokens)
            engine.stop_trace()
            trace = trace_problems(str(work / "trace" / "routes" / "**" / "part-*.parquet"), got, case.layout.dp)
            rec["trace_problems"] = len(trace)
            problems += trace
            if case.mode == "exact":
                assert refs.exact is not None
                diff = exact_diff(refs.exact, got)
                rec |= {k: getattr(diff, k) for k in ("requests", "token_mismatches", "logprob_mismatches",
                                                      "route_entries", "route_mismatches", "weight_mismatches")}
                problems += diff.problems
            else:
                assert refs.default is not None and refs.gaps is not None
                dd = default_diff(refs.default, got, refs.gaps, cfg.near_tie)
                rec |= {"requests": dd.requests, "token_mismatches": dd.token_mismatches,
                        "max_logprob_diff": dd.max_logprob_diff, "route_entries": dd.flips.entries,
                        "route_mismatches": dd.flips.far, "near_ties": dd.flips.near_ties,
                        "near_tie_flips": dd.flips.flips, "smallest_gap": dd.flips.smallest_gap}  # fmt: skip
                problems += dd.problems
            if case.dispatch != "none":
                moe = list(engine.model_config.moe_layer_ids)
                bad, checked = physical_mismatches(engine.expert_slots(), [o for v in got.values() for o in v], moe)
                rec["physical"] = {"mismatches": bad, "checked": checked}
                if bad or not checked:
                    problems.append(f"physical ids: {bad} of {checked} routed pairs name a slot holding another expert")
            if case.rebalance:
                problems += _rebalance(engine, cfg, refs, work, rec)
    except Exception as exc:  # a case that crashes is a finding; the other cases still run
        rec["status"] = "error"
        rec["problems"] = [f"{type(exc).__name__}: {exc}"] + problems[:5]
        rec["traceback"] = traceback.format_exc()[-4000:]
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        return rec
    rec["status"] = "fail" if problems else "pass"
    rec["problems"] = problems[:10]
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def _rebalance(engine: Engine, cfg: MatrixConfig, refs: References, work: Path, rec: dict[str, Any]) -> list[str]:
    """A shuffled placement applied while the rebalance requests run; they, and two more after it, must equal the
    one-process run bitwise."""
    assert refs.rebalance is not None
    mc = engine.model_config
    source = write_placement(work / "placement.json", 5, mc.num_hidden_layers, mc.n_routed_experts)
    prompts = rebalance_prompts()
    run = rebalance_run(engine, prompts, cfg.rebalance_tokens, source)
    during = exact_diff({"rebalance": refs.rebalance}, {"rebalance": run["results"]})
    after = exact_diff({"after": refs.rebalance[:2]}, {"after": plain_run(engine, prompts[:2], cfg.rebalance_tokens)})
    update = run["update"]
    rec["rebalance_run"] = {"chunks": update.get("chunks"), "slots_copied": update.get("slots_copied"),
                            "chunks_after_update": run["chunks_after_update"],
                            "route_mismatches": during.route_mismatches + after.route_mismatches,
                            "token_mismatches": during.token_mismatches + after.token_mismatches}  # fmt: skip
    problems = during.problems + after.problems
    if not update.get("chunks") or not sum(update.get("slots_copied") or [0]):
        problems.append(f"rebalance: the update copied nothing ({update})")
    if run["chunks_after_update"] == 0:
        problems.append(f"rebalance: the requests finished before the update did (raise --rebalance-tokens from "
                        f"{cfg.rebalance_tokens})")  # fmt: skip
    return problems
