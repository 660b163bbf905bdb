"""r3trace eplb TRACE --gpus 32 --nodes 4 --slots 288 --policy ours: plan a placement from a trace's heat."""

from __future__ import annotations

import argparse

HELP = "plan an expert placement from a trace's heat and export it (JSON, SGLang init-expert-location)"
POLICIES = ("ours", "global", "hierarchical", "cross_node")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="dataset folder or run folder")
    p.add_argument("--run-id", default=None)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--slots", type=int, required=True, help="physical expert slots P in total")
    p.add_argument("--groups", type=int, default=None, help="expert groups (default: the manifest's)")
    p.add_argument("--node-limit", type=int, default=4)
    p.add_argument("--policy", choices=POLICIES, default="ours")
    p.add_argument("--window-s", type=float, default=None, help="ours: EMA over heat windows of this length")
    p.add_argument("--out", default=None, help="placement JSON (all three tensors)")
    p.add_argument("--sglang", default=None, help="SGLang init-expert-location JSON")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from r3trace.analysis.heat import HeatSource, heat, heat_windows
    from r3trace.analysis.store import TraceStore
    from r3trace.eplb import Cluster, cross_node, global_policy, hierarchical, plan, to_json, to_sglang
    from r3trace.eplb.score import balancedness, even_gpu_load

    store = TraceStore(args.trace)
    run_ids = [r.manifest.run_id for r in store.runs]
    run_id = args.run_id or (run_ids[0] if len(run_ids) == 1 else None)
    if run_id is None:
        raise SystemExit(f"{args.trace} holds runs {run_ids}; pick one with --run-id")
    m = store.run(run_id).manifest
    source: HeatSource = "rollups" if m.kind == "heat" else "routes"
    layer_index = {lid: i for i, lid in enumerate(m.moe_layer_ids)}

    def dense(df: object) -> np.ndarray:
        out = np.zeros((m.num_moe_layers, m.num_experts))
        for lid, e, c in df.select("layer_id", "expert_id", "count").iter_rows():  # type: ignore[attr-defined]
            out[layer_index[lid], e] += c
        return out

    total = dense(heat(store.con, run_id, source=source))
    cluster = Cluster(args.gpus, args.nodes, args.slots, num_groups=args.groups or m.num_groups,
                      node_limit=args.node_limit)
    if args.policy == "ours":
        loads = total
        if args.window_s:
            win = heat_windows(store.con, args.window_s, run_id, source=source)
            loads = np.stack([dense(g) for _, g in win.group_by("window_start", maintain_order=True)])
        placement = plan(loads, cluster)
    else:
        placement = {"global": global_policy, "hierarchical": hierarchical, "cross_node": cross_node}[
            args.policy](total, cluster)
    print(f"{args.policy}: P={args.slots} on {args.gpus} GPUs / {args.nodes} nodes, "
          f"in-sample balancedness {balancedness(even_gpu_load(placement, total, cluster)):.4f}, "
          f"max replicas {int(placement.logcnt.max())}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(to_json(placement, cluster, {"policy": args.policy, "run_id": run_id}))
    if args.sglang:
        to_sglang(placement, args.sglang)
    return 0
