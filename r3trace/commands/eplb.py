"""r3trace eplb TRACE --gpus 32 --nodes 4 --slots 288 [--train time=..600 --eval time=600..]: plan a placement
from a trace's heat, pick the policy by backtest (--policy auto), and score it in-sample and held out."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from r3trace.commands.args import nonnegative_int, positive_float, positive_int
from r3trace.eplb.window import window_spec

if TYPE_CHECKING:
    from r3trace.eplb.evaluate import DispatchName

HELP = "plan an expert placement from a trace (policy chosen by backtest), score it held out, export it"
POLICIES = ("auto", "ours", "global", "hierarchical", "cross_node")
FORECASTS = ("ema", "mean", "newest")
DISPATCHES = ("node-limited", "static", "dynamic")  # evaluate.DISPATCHES, no numpy import (test_cli_choice_lists)
WINDOW_HELP = "time=A..B (seconds from the run's start), forward=A..B or runs=ID,ID; [A, B), either end optional"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="dataset folder or run folder")
    p.add_argument("--run-id", default=None, help="the run of time= and forward= windows")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs in the expert-parallel group")
    p.add_argument("--nodes", type=positive_int, required=True, help="nodes those GPUs sit on (it divides --gpus)")
    p.add_argument("--slots", type=positive_int, required=True, help="physical expert slots P in total")
    p.add_argument("--groups", type=positive_int, default=None, help="expert groups (default: the manifest's)")
    p.add_argument("--node-limit", type=positive_int, default=4,
                   help="most nodes a token's experts may reach (DeepSeek-V3: 4); the report counts token-layers "
                        "over it")
    p.add_argument("--policy", choices=POLICIES, default="auto",
                   help="auto (default): ours on the ema forecast unless another policy x forecast leads it, fold "
                        "by fold held out on the training window, by more than 2 standard errors (docs/cli.md)")
    p.add_argument("--forecast", choices=FORECASTS, default=None,
                   help="heat the policy plans on: ema, mean (whole window) or newest history window "
                        "(default: auto picks; ours ema, the others mean)")
    p.add_argument("--train", type=window_spec, default=None, help=f"training window: {WINDOW_HELP} (default: "
                   "the whole run, or what precedes --eval)")
    p.add_argument("--eval", type=window_spec, default=None, dest="held_out",
                   help=f"held-out window: {WINDOW_HELP} (default: what follows --train)")
    p.add_argument("--windows", type=positive_int, default=None,
                   help="history windows the training window is cut into (default 8, or as many as it holds)")
    p.add_argument("--window-s", type=positive_float, default=None,
                   help="history windows of this many seconds instead (a multiple of the rollup window)")
    p.add_argument("--dispatch", choices=DISPATCHES, default=None,
                   help="the dispatcher ours plans for and auto's backtest and the worst layers judge by: "
                        "node-limited (the fewest nodes covering a token's experts; the default without --sglang), "
                        "or SGLang's --ep-dispatch-algorithm static (a rank's own replica, else its node's first, "
                        "else one spread over the replicas; ours then puts the hottest experts' replicas all on one "
                        "node or one a node, which that dispatcher splits evenly, within DeepSeek global's nodes per "
                        "token; the default with --sglang, as SGLang runs it once that file is loaded and no "
                        "--ep-dispatch-algorithm is given) "
                        "or dynamic (the same first two rules, else a random replica a pair; planned for as static). "
                        "Every figure is printed either way")
    p.add_argument("--keep-groups", action="store_true",
                   help="ours with every expert's first replica on its group's home node (whole groups on nodes, "
                        "as DeepSeek's hierarchical policy places them): a token reaches no more nodes than it picks "
                        "groups (V3: 4), as under that policy, extra replicas only add choices (BENCHMARKS.md, "
                        "EPLB with groups kept); plans for node-limited dispatch, with no backtest")
    p.add_argument("--replay-tokens", type=positive_int, default=8192,
                   help="tokens replayed through node-limited dispatch per scored window")
    p.add_argument("--mix-tokens", type=nonnegative_int, default=2048,
                   help="tokens a history window read to fit the kinds of token behind the windows (prompts' "
                        "domains, topics): ours plans on the windows at their long-run mix where a backtest says "
                        "that forecasts the next window better (docs/analysis.md, \"Token mix\"); 0: the raw windows")
    p.add_argument("--previous", default=None,
                   help="the placement the cluster runs: a JSON written by --out, SGLang's --init-expert-location "
                        "file (.json or .pt, as --sglang writes), or 'recorded': the map the run (with runs= "
                        "windows, the last training run) ran at the training window's newest forward, from the "
                        "trace's placements table (an r3trace engine records it; an SGLang per_token dump's ingest "
                        "too); ours re-plans from it, and the report prints churn against it "
                        "and its own scores, kept as is, beside the plan's")
    p.add_argument("--out", default=None, help="placement JSON: DeepSeek EPLB's phy2log, log2phy, logcnt (MoE layers)"
                   " and the report's figures under meta.report")
    p.add_argument("--sglang", default=None,
                   help="the file SGLang's --init-expert-location loads (.json or .pt; every layer's row)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from r3trace.analysis.store import open_store
    from r3trace.commands.args import select_run
    from r3trace.commands.eplb_lines import report_lines
    from r3trace.eplb import Cluster, to_json, to_sglang
    from r3trace.eplb.placement import PlacementError
    from r3trace.eplb.plan_request import PlanRequest
    from r3trace.eplb.previous import RECORDED, read_previous, recorded_previous
    from r3trace.eplb.report import make_report
    from r3trace.eplb.window import WindowError
    from r3trace.errors import StoreError, UsageError
    from r3trace.progress import progress_flag

    if args.sglang and not args.sglang.endswith((".json", ".pt")):  # refused before the trace is scanned
        raise UsageError(f"--sglang {args.sglang}: must end in .json or .pt (SGLang's --init-expert-location "
                         "parses any other value as inline JSON)")
    for flag, out in (("--out", args.out), ("--sglang", args.sglang)):  # before the plan, not after its seconds
        if out and not Path(out).parent.is_dir():
            raise UsageError(f"{flag} {out}: folder {Path(out).parent} does not exist")
        if out and Path(out).is_dir():
            raise UsageError(f"{flag} {out}: is a folder; give a file path")
    by_runs = any(s is not None and s.kind == "runs" for s in (args.train, args.held_out))
    if by_runs and args.run_id:
        raise UsageError(f"--run-id {args.run_id}: not used with runs= windows (they name their runs)")
    store = open_store(args.trace)
    ids = [r.manifest.run_id for r in store.runs]
    run_id = None if by_runs else select_run(ids, args.run_id, args.trace)
    named = [r for spec in (args.train, args.held_out) if spec is not None for r in spec.runs]
    for r in named:
        if r not in ids:
            flag = "--train" if args.train is not None and r in args.train.runs else "--eval"
            raise StoreError(f"{flag} runs={r}: no such run in {args.trace} (runs: {', '.join(ids)})")
    m = store.run(run_id or named[0]).manifest
    # a cluster that cannot hold the trace's experts is refused before the trace is scanned
    flags = f"--gpus {args.gpus} --nodes {args.nodes} --slots {args.slots}"
    if args.slots < m.num_experts:
        raise UsageError(f"{flags}: fewer slots than run {m.run_id}'s {m.num_experts} experts; give --slots >= "
                         f"{m.num_experts}, a multiple of --gpus")
    if args.windows is not None and args.window_s is not None:
        raise UsageError(f"--windows {args.windows} --window-s {args.window_s:g}: give one (how many history windows, "
                         "or how long each is)")
    if args.groups is not None and m.num_experts % args.groups:
        raise UsageError(f"--groups {args.groups}: does not divide run {m.run_id}'s {m.num_experts} experts (its "
                         f"router has {m.num_groups} groups)")
    try:
        cluster = Cluster(args.gpus, args.nodes, args.slots, num_groups=args.groups or m.num_groups,
                          node_limit=args.node_limit)
    except PlacementError as e:
        raise UsageError(f"{flags}: {e}") from e
    previous = None
    if args.previous:
        try:
            trained = args.train.runs if args.train is not None and args.train.kind == "runs" else named
            ran = run_id or trained[-1]
            if args.previous == RECORDED:  # checked here, before the scan; read at the training window's end
                recorded_previous(store.run(ran), cluster)
            previous = (RECORDED if args.previous == RECORDED else
                        read_previous(args.previous, cluster, m.num_hidden_layers, m.moe_layer_ids, m.num_experts))
        except PlacementError as e:
            raise UsageError(f"--previous {e}") from e
    asked = {} if args.windows is None else {"windows": args.windows}  # else PlanRequest's default
    dispatch: DispatchName = args.dispatch or ("static" if args.sglang else "node-limited")
    if args.keep_groups and args.policy not in ("auto", "ours"):
        raise UsageError(f"--keep-groups: a layout of --policy ours; --policy {args.policy} places by its own rule")
    if args.keep_groups and dispatch != "node-limited":
        implied = "" if args.dispatch else " (the default with --sglang)"
        raise UsageError(f"--keep-groups: plans for node-limited dispatch (a token's cover within its groups' "
                         f"nodes), not --dispatch {dispatch}{implied}; give --dispatch node-limited")
    req = PlanRequest(cluster, args.policy, args.forecast, args.train, args.held_out, run_id, window_s=args.window_s,
                      replay_tokens=args.replay_tokens, previous=previous, dispatch=dispatch,
                      keep_groups=args.keep_groups, mix_tokens=args.mix_tokens, **asked)
    try:
        rep = make_report(store, req, progress_flag(args.progress))
    except WindowError as e:
        raise UsageError(str(e)) from e
    except PlacementError as e:  # a recorded map that starts after the training window's end
        raise UsageError(f"--previous {e}") from e
    label = rep.previous_at if args.previous == RECORDED else args.previous
    print("\n".join(report_lines(rep, cluster, m.moe_layer_ids, label, args.windows)))
    if args.out:
        meta: dict[str, object] = {"policy": rep.policy, "forecast": rep.forecast, "run_id": rep.train.runs[0],
                "moe_layer_ids": list(m.moe_layer_ids), "report": rep.to_dict()}
        Path(args.out).write_text(to_json(rep.placement, cluster, meta))
    if args.sglang:
        to_sglang(rep.placement, args.sglang, m.num_hidden_layers, m.moe_layer_ids)
        print("\n".join(sglang_lines(args.sglang, args.gpus, args.slots - m.num_experts, dispatch,
                                      args.dispatch is None)))
    return 0


def sglang_lines(path: str, gpus: int, redundant: int, dispatch: str, implied: bool) -> list[str]:
    """What `--sglang` prints after writing the file: the dispatcher the plan was made for (where --dispatch was not
    given, static: SGLang's own choice once --init-expert-location is loaded with --ep-dispatch-algorithm unset,
    python/sglang/srt/server_args.py _handle_eplb_and_dispatch) and SGLang's flags, the dispatcher named outright."""
    out = []
    if implied:
        out.append("dispatch: planned for SGLang's static dispatch, what SGLang runs with this file and no "
                   "--ep-dispatch-algorithm (--dispatch dynamic or node-limited plans for another)")
    elif dispatch == "node-limited":
        out.append("warning: planned for node-limited dispatch, which SGLang does not run: with this file it "
                   "dispatches static unless --ep-dispatch-algorithm dynamic (--dispatch static plans for it)")
    algo = f" --ep-dispatch-algorithm {dispatch}" if dispatch in ("static", "dynamic") else ""
    # SGLang's slots are its logical experts plus --ep-num-redundant-experts, split over the EP ranks
    return out + [f"SGLang: --init-expert-location {path} --expert-parallel-size {gpus} "
                  f"--ep-num-redundant-experts {redundant}{algo}"]
