"""r3trace eplb TRACE --gpus 32 --nodes 4 --slots 288 --policy ours: plan a placement from a trace's heat."""

from __future__ import annotations

import argparse

from r3trace.commands.args import positive_float, positive_int

HELP = "plan an expert placement from a trace's heat and export it (JSON, SGLang init-expert-location)"
POLICIES = ("ours", "global", "hierarchical", "cross_node")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="dataset folder or run folder")
    p.add_argument("--run-id", default=None)
    p.add_argument("--gpus", type=positive_int, required=True)
    p.add_argument("--nodes", type=positive_int, required=True)
    p.add_argument("--slots", type=positive_int, required=True, help="physical expert slots P in total")
    p.add_argument("--groups", type=positive_int, default=None, help="expert groups (default: the manifest's)")
    p.add_argument("--node-limit", type=positive_int, default=4)
    p.add_argument("--policy", choices=POLICIES, default="ours")
    p.add_argument("--window-s", type=positive_float, default=None,
                   help="ours: EMA over heat windows of this length")
    p.add_argument("--out", default=None, help="placement JSON: DeepSeek EPLB's phy2log, log2phy, logcnt (MoE layers)")
    p.add_argument("--sglang", default=None,
                   help="the file SGLang's --init-expert-location loads (.json or .pt; every layer's row)")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from r3trace.analysis.heat import HeatSource, heat, heat_windows
    from r3trace.analysis.store import open_store
    from r3trace.commands.args import select_run
    from r3trace.eplb import Cluster, cross_node, global_policy, hierarchical, plan, to_json, to_sglang
    from r3trace.eplb.placement import PlacementError
    from r3trace.eplb.score import balancedness, even_gpu_load
    from r3trace.errors import StoreError, UsageError
    from r3trace.progress import progress_flag

    if args.sglang and not args.sglang.endswith((".json", ".pt")):  # refused before the trace is scanned
        raise UsageError(f"--sglang {args.sglang}: must end in .json or .pt (SGLang's --init-expert-location "
                         "parses any other value as inline JSON)")
    store = open_store(args.trace)
    run_id = select_run([r.manifest.run_id for r in store.runs], args.run_id, args.trace)
    m = store.run(run_id).manifest
    # a cluster that cannot hold the trace's experts is refused before the trace is scanned
    flags = f"--gpus {args.gpus} --nodes {args.nodes} --slots {args.slots}"
    if args.slots < m.num_experts:
        raise UsageError(f"{flags}: fewer slots than run {run_id}'s {m.num_experts} experts; give --slots >= "
                         f"{m.num_experts}, a multiple of --gpus")
    try:
        cluster = Cluster(args.gpus, args.nodes, args.slots, num_groups=args.groups or m.num_groups,
                          node_limit=args.node_limit)
    except PlacementError as e:
        raise UsageError(f"{flags}: {e}") from e
    source: HeatSource = "rollups" if m.kind == "heat" else "routes"
    layer_index = {lid: i for i, lid in enumerate(m.moe_layer_ids)}
    progress = progress_flag(args.progress)

    def dense(df: object) -> np.ndarray:
        out = np.zeros((m.num_moe_layers, m.num_experts))
        for lid, e, c in df.select("layer_id", "expert_id", "count").iter_rows():  # type: ignore[attr-defined]
            out[layer_index[lid], e] += c
        return out

    total = dense(heat(store.con, run_id, source=source, progress=progress))
    if not total.any():
        raise StoreError(f"run {run_id} in {args.trace} has no routes to plan from (0 rows)")
    if args.policy == "ours":
        loads = total
        if args.window_s:
            win = heat_windows(store.con, args.window_s, run_id, source=source, progress=progress)
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
            f.write(to_json(placement, cluster, {"policy": args.policy, "run_id": run_id,
                                               "moe_layer_ids": list(m.moe_layer_ids)}))
    if args.sglang:
        to_sglang(placement, args.sglang, m.num_hidden_layers, m.moe_layer_ids)
        # SGLang's slots are its logical experts plus --ep-num-redundant-experts, split over the EP ranks
        print(f"SGLang: --init-expert-location {args.sglang} --expert-parallel-size {args.gpus} "
              f"--ep-num-redundant-experts {args.slots - m.num_experts}")
    return 0
