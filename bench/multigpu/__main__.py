"""python -m bench.multigpu --gpus G [--out FILE]: the parallel matrix and the per-GPU throughput in one call.

  python -m bench.multigpu --gpus 2 --out $OUT/multigpu-nvidia-h200-x2.json   # NCCL, G GPUs
  python -m bench.multigpu --smoke                                              # CPU, gloo, 2 ranks, tiny sizes

Order: the matrix cases of G GPUs, then throughput, then the matrix cases of fewer GPUs (a smaller machine covers
those), each started only while --budget-s leaves time for it; a case not run says why ("needs 8 GPUs", "not run:
time budget", a refusal of the model). The result file is rewritten after every case, so a run cut short keeps what
it measured; the markdown tables are printed at the end. Exit status 1 when a case failed.
"""

from __future__ import annotations

from bench.multigpu.env import disable_multicast

ENVIRONMENT = disable_multicast()  # before torch is imported: every process started from here on inherits it

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.multigpu.cases import WORLDS, Case, Layout, matrix  # noqa: E402
from bench.multigpu.matrix import MatrixConfig, references, run_case  # noqa: E402
from bench.multigpu.report import engine_option_names, features, markdown  # noqa: E402
from bench.multigpu.throughput import PerfConfig, measure, ratios  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOKE_PERF = PerfConfig(device="cpu", dtype="float32", backend="ref", prefill_tokens=(32, 64), prompt=16,
                        batches=(2, 4), decode_prompt=8, new_tokens=4, reps=1)  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.multigpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to use (the device kind's count)")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, a world of 2, tiny sizes")
    ap.add_argument("--kind", default="", help="the device kind's name in the results (default: from the device)")
    ap.add_argument("--out", default="", help="result JSON (default bench/results/multigpu-<kind>.json)")
    ap.add_argument("--only", default="matrix,throughput", help="parts to run: matrix, throughput")
    ap.add_argument("--cases", default="", help="comma-separated case-name prefixes (default: every case)")
    ap.add_argument("--shapes", default="v3-2.5b,v3-moe256", help="bench/random_checkpoint.py shapes to time")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start nothing that would end past this")
    ap.add_argument("--model", default=str(ROOT / "samples" / "model"), help="the matrix's model")
    ap.add_argument("--rebalance-tokens", type=int, default=0, help="tokens of each rebalance request (0: 64 on "
                    "a GPU, 24 on the CPU)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ckpt-dir", default="", help="where the random checkpoints go (default: a temporary folder)")
    ap.add_argument("--tables", default="", help="print the markdown tables of this result file; run nothing")
    args = ap.parse_args(argv)
    if not args.smoke and not args.tables and args.gpus < 1:
        ap.error("--gpus: give the GPU count (or --smoke)")
    if args.smoke:
        args.gpus = 2
    return args


class Budget:
    """Seconds left; a unit of some kind starts only if the longest one of its kind so far (at first: its guess)
    still fits. The result file is saved after every unit, so one that overruns a device's limit loses only itself."""

    def __init__(self, seconds: float, guesses: dict[str, float]) -> None:
        self.end = time.perf_counter() + seconds
        self.longest: dict[str, float] = {}
        self.guesses = guesses

    def fits(self, kind: str) -> bool:
        return self.end - time.perf_counter() >= self.longest.get(kind, self.guesses[kind.split("-")[0]])

    def spent(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)


# first guesses, GPU: a case's engine start and workload; a throughput engine (load, compile, 6 sizes x 2 reps);
# writing a random checkpoint (8.5 GB for v3-moe256)
GUESSES = {"case": 60.0, "perf": 150.0, "checkpoint": 60.0}
SMOKE_GUESSES = {"case": 120.0, "perf": 120.0, "checkpoint": 10.0}


def device_info(args: argparse.Namespace) -> dict[str, Any]:
    if args.smoke:
        return {"kind": args.kind or "cpu-smoke", "device": "cpu", "backend": "gloo", "torch": torch.__version__}
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise SystemExit(f"--gpus {args.gpus}: {have} CUDA devices visible")
    name = torch.cuda.get_device_name(0)
    kind = args.kind or name.lower().replace(" ", "-") + (f"-x{args.gpus}" if args.gpus > 1 else "")  # nvidia-h200-x2
    return {"kind": kind, "device": name, "gpus_visible": torch.cuda.device_count(), "backend": "nccl",
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "torch": torch.__version__}  # fmt: skip


def mtp_refusal(model: Path, device: str) -> str | None:
    """The engine's refusal of MTP under DP attention (raised before any rank starts), None if it accepts it."""
    from r3trace.engine import Engine
    from r3trace.engine.engine_config import EngineConfigError

    try:
        Engine(model, device=device, tp_size=2, dp_size=2, speculative_algorithm="NEXTN").shutdown()
    except EngineConfigError as exc:
        return str(exc)
    return None


def selected(case: Case, prefixes: list[str]) -> bool:
    return not prefixes or any(case.name.startswith(p) for p in prefixes)


def run_matrix(cases: list[Case], args: argparse.Namespace, budget: Budget, result: dict[str, Any], save: Any,
               refs: Any, cfg: MatrixConfig) -> None:
    from r3trace.engine.model_config import ModelConfig

    heads = ModelConfig.from_hf(cfg.model).num_attention_heads
    for case in cases:
        refusal = case.refusal(args.gpus, heads)
        if refusal is None and not budget.fits("case"):
            refusal = "not run: time budget"
        if refusal is not None:
            rec: dict[str, Any] = {"case": case.name, "gpus": case.gpus, "mode": case.mode, "status": refusal}
        else:
            rec = run_case(case, cfg, refs)
            budget.spent("case", rec["seconds"])
        print(f"[matrix] {rec['case']}: {rec['status']} {rec.get('problems', [])[:2]}", flush=True)
        if rec["status"] == "error":
            print(rec["traceback"][-1500:], flush=True)
        result["matrix"]["cases"].append(rec)
        save()


def run_throughput(args: argparse.Namespace, budget: Budget, result: dict[str, Any], save: Any, tmp: Path) -> None:
    from bench.multigpu.checkpoints import random_checkpoint, shape_summary

    cfg = SMOKE_PERF if args.smoke else PerfConfig(reps=args.reps)
    result["throughput"] = {"config": asdict(cfg), "shapes": {}}
    g = max(args.gpus, 2)  # on one GPU the multi-GPU rows say they need 2
    plan = [(Layout(1), True), (Layout(1), False), (Layout(g, g), False), (Layout(g, g, g), False)]
    for shape in ["tiny"] if args.smoke else args.shapes.split(","):
        rows: list[dict[str, Any]] = []
        result["throughput"]["shapes"][shape] = {"rows": rows}
        if not (budget.fits("checkpoint") and budget.fits("perf-1")):  # not even the one-GPU rows: no checkpoint
            rows += [{"layout": lay.name if lay.tp > 1 else "1gpu", "gpus": lay.tp, "status": "not run: time budget"}
                     for lay, _ in plan]  # fmt: skip
            continue
        t0 = time.perf_counter()
        ckpt = random_checkpoint(Path(args.ckpt_dir) if args.ckpt_dir else tmp / "ckpt", shape)
        budget.spent("checkpoint", time.perf_counter() - t0)
        result["throughput"]["shapes"][shape]["summary"] = shape_summary(ckpt)
        for layout, graphs in plan:
            name = layout.name if layout.tp > 1 else "1gpu"
            if graphs and args.smoke:
                rows.append({"layout": name, "gpus": 1, "status": "needs CUDA (graphs)"})
            elif layout.tp > args.gpus:
                rows.append({"layout": name, "gpus": layout.tp, "status": f"needs {layout.tp} GPUs"})
            elif not budget.fits(f"perf-{layout.tp}"):
                rows.append({"layout": name, "gpus": layout.tp, "status": "not run: time budget"})
            else:
                t0 = time.perf_counter()
                capture = ("routes", "trace") if layout.tp > 1 else ("routes",) if graphs else ()
                try:
                    rows.append(measure(ckpt, layout, graphs, cfg, capture, tmp))
                except Exception as exc:  # a layout that fails is a finding; the others still run
                    rows.append({"layout": name, "gpus": layout.tp, "error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()[-4000:]})  # fmt: skip
                    print(rows[-1]["traceback"][-1500:], flush=True)
                budget.spent(f"perf-{layout.tp}", time.perf_counter() - t0)
                gc.collect()  # the one-GPU engine ran in this process: its tensors go before the next engine's
                if not args.smoke:
                    torch.cuda.empty_cache()
            print(f"[throughput] {shape} {name}: {json.dumps(rows[-1])[:400]}", flush=True)
            ratios(rows)
            save()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.tables:  # a run cut short by a device's time limit saved its result file, not its tables
        print(markdown(json.loads(Path(args.tables).read_text())))
        return 0
    info = device_info(args)
    # the smoke keeps nothing in the repository
    results = Path(tempfile.gettempdir()) if args.smoke else ROOT / "bench" / "results"
    out = Path(args.out or results / f"multigpu-{info['kind']}.json")
    result: dict[str, Any] = {**info, "gpus": args.gpus, "argv": sys.argv[1:], "environment": ENVIRONMENT}
    device = "cpu" if args.smoke else "cuda"
    result["features"] = features(engine_option_names(), mtp_refusal(Path(args.model), device))

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))

    budget = Budget(args.budget_s, SMOKE_GUESSES if args.smoke else GUESSES)
    parts = args.only.split(",")
    prefixes = [p for p in args.cases.split(",") if p]
    with tempfile.TemporaryDirectory(prefix="r3trace-multigpu-") as tmp_dir:
        tmp = Path(tmp_dir)
        first: list[Case] = []
        later: list[Case] = []
        if "matrix" in parts:
            cfg = MatrixConfig(Path(args.model), device, default_backend="ref" if args.smoke else "triton",
                               rebalance_tokens=args.rebalance_tokens or (24 if args.smoke else 64),
                               long_tokens=40 if args.smoke else 100, tmp=tmp)  # GPU steps take ms, not 75 ms
            cases = [c for c in matrix(WORLDS) if selected(c, prefixes)]
            first = [c for c in cases if c.gpus == args.gpus or c.gpus > args.gpus]
            later = [c for c in cases if c.gpus < args.gpus]
            result["matrix"] = {"model": str(cfg.model), "dtype": cfg.dtype, "near_tie": cfg.near_tie, "cases": []}
            refs = references(cfg, {c.mode for c in cases})  # on one GPU: the only part of the matrix that runs
            result["matrix"]["references"] = refs.records
            save()
            run_matrix(first, args, budget, result, save, refs, cfg)
        if "throughput" in parts:
            run_throughput(args, budget, result, save, tmp)
        if later:
            run_matrix(later, args, budget, result, save, refs, cfg)
    result["seconds"] = round(args.budget_s - (budget.end - time.perf_counter()), 1)
    save()
    print(markdown(result))
    print(f"results: {out}")
    matrix_part = result.get("matrix", {})
    failed = [c["case"] for c in matrix_part.get("cases", []) if c["status"] in ("fail", "error")]
    failed += [r["reference"] for r in matrix_part.get("references", []) if r["status"] != "pass"]
    failed += [f"{s}/{r['layout']}" for s, v in result.get("throughput", {}).get("shapes", {}).items()
               for r in v["rows"] if "error" in r]  # fmt: skip
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
