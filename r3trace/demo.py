"""`make demo` / `r3trace demo`: the main job end to end on the bundled sample model, on the CPU.

1. load samples/model (a DeepSeek-V3-architecture model trained for this project) into the engine and
   serve it over HTTP on a loopback port (the real server, so this is the path clients take);
2. record a trace (POST /start_trace) while the bundled prompts are generated with
   return_routed_experts=true, each response's routes decoded and checked;
3. open the trace with DuckDB (TraceStore) and print the heat summary, per-layer imbalance, and EPLB
   plans replayed on the trace's own tokens;
4. say how to open the dashboard.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HELP = "run the demo: sample model -> HTTP server with capture -> Parquet trace -> stats and EPLB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(REPO / "samples" / "model"))
    p.add_argument("--prompts", default=str(REPO / "samples" / "prompts.jsonl"))
    p.add_argument("--out", default="out/demo", help="trace root (the run goes under it)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=192, help="prompts are cut to this many tokens")
    p.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients")


def _load_prompts(path: Path, tokenizer: Any, max_tokens: int) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:  # cut on token boundaries so every prompt fits the demo's time budget
        r["input_ids"] = tokenizer.encode(r["text"])[:max_tokens]
    return rows


def run(args: argparse.Namespace) -> int:
    import httpx
    import numpy as np
    from tqdm import tqdm

    import r3trace
    from r3trace.engine import Engine
    from r3trace.server import ServerConfig, create_app
    from r3trace.server.background import BackgroundServer
    from r3trace.trace.reader import open_dataset

    t_start = time.perf_counter()
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise SystemExit(f"model folder {model} has no config.json (the bundled one is samples/model)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    print(f"[1/4] loading {model} into the engine (fp32, CPU, ref backends) and serving it on loopback")
    engine = Engine(model, chunked_prefill_size=1024, max_running_requests=64, kv_pool_tokens=32768)
    mc = engine.model_config
    print(f"      DeepSeek-V3 architecture: {mc.num_hidden_layers} layers (MoE layers {list(mc.moe_layer_ids)}), "
          f"{mc.n_routed_experts} experts in {mc.n_group} groups, top-{mc.num_experts_per_tok}, MLA "
          f"kv_lora {mc.kv_lora_rank} + rope {mc.qk_rope_head_dim}")
    prompts = _load_prompts(Path(args.prompts), engine.tokenizer, args.max_prompt_tokens)
    app = create_app(engine, ServerConfig(model_name=model.name, trace_root=out))
    rows_checked = 0
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=600) as http:
        print(f"[2/4] {server.url}: POST /start_trace, then {len(prompts)} prompts over {args.clients} clients "
              "with return_routed_experts=true")
        http.post("/start_trace", json={"trace_dir": ".", "run_id": run_id}).raise_for_status()

        def one(p: dict[str, Any]) -> dict[str, Any]:
            body = {"input_ids": p["input_ids"], "return_routed_experts": True, "tag": p.get("domain"),
                    "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0}}
            resp = http.post("/generate", json=body)
            resp.raise_for_status()
            return dict(resp.json())

        with ThreadPoolExecutor(args.clients) as pool:
            for p, res in tqdm(zip(prompts, pool.map(one, prompts), strict=True), total=len(prompts),
                               desc="generate", unit="req"):
                routes = r3trace.decode_routed_experts(res["meta_info"])
                n = len(p["input_ids"]) + len(res["output_ids"]) - (1 if res["output_ids"] else 0)
                dense = [i for i in range(mc.num_hidden_layers) if i not in mc.moe_layer_ids]
                if routes.shape != (n, mc.num_hidden_layers, mc.num_experts_per_tok) or (
                        dense and not (routes[:, dense] == -1).all()):
                    raise SystemExit(f"request {p['id']}: routes of shape {routes.shape}, expected {n} rows")
                rows_checked += n
        stopped = http.post("/stop_trace").json()
        metrics = http.get("/metrics").text
    engine.shutdown()
    payload = next((ln.split()[-1] for ln in metrics.splitlines()
                    if ln.startswith("r3trace_capture_bytes_total")), "?")
    run_dir = out / f"run_id={run_id}"
    size = sum(f.stat().st_size for r in open_dataset(run_dir) for f in r.listed_files)
    print(f"      {rows_checked} route rows returned and checked (shape, dense layers -1); "
          f"{payload} bytes of int32 ids returned (/metrics)")
    detail = (stopped.get("detail") or {}).get("result") or {}
    print(f"[3/4] trace: {run_dir} ({detail.get('rows', '?')} rows, {size / 1024:.0f} KB of Parquet)")
    _report(out, run_id, np)
    print(f"[4/4] open the dashboard:  .venv/bin/r3trace dashboard {out}")
    print(f"      query it with SQL:    .venv/bin/r3trace sql \"SELECT layer_id, count(*) FROM routes GROUP BY 1\" "
          f"--store {out}")
    print(f"done in {time.perf_counter() - t_start:.1f} s")
    return 0


def _report(out: Path, run_id: str, np: Any) -> None:
    import polars as pl

    from r3trace.analysis.heat import heat, imbalance
    from r3trace.analysis.locality import specialisation
    from r3trace.analysis.store import TraceStore
    from r3trace.eplb.evaluate import evaluate_policy
    from r3trace.eplb.placement import Cluster
    from r3trace.trace import read_token_routes

    store = TraceStore(out)
    m = store.run(run_id).manifest
    h = heat(store.con, run_id, source="rollups")
    weight = np.zeros((m.num_moe_layers, m.num_experts))
    index = {lid: i for i, lid in enumerate(m.moe_layer_ids)}
    for lid, e, c in h.iter_rows():
        weight[index[lid], e] = c
    print("      heat summary (from the rollups, no scan): hottest experts per layer")
    for lid, w in zip(m.moe_layer_ids, weight, strict=True):
        top = np.argsort(-w)[:4]
        share = ", ".join(f"e{e} {100 * w[e] / w.sum():.1f}%" for e in top)
        print(f"        layer {lid}: {share}   (uniform would be {100 / m.num_experts:.1f}% each)")
    imb = imbalance(store.con, run_id)
    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True, float_precision=3):
        print("      per-layer imbalance:")
        print(imb)
    spec = specialisation(store.con, run_id=run_id)
    if spec.height:
        by_tag = spec.group_by("group").agg(pl.col("kl_bits").mean(), pl.col("top_share").mean()).sort("group")
        print("      domain specialisation (mean over layers; KL of a domain's expert use vs the layer's, bits):")
        for tag, kl, share in by_tag.iter_rows():
            print(f"        {tag:18s} KL {kl:.3f} bits, top-{m.top_k} experts take {100 * share:.0f}% of its picks")
    tokens = read_token_routes(store.run(run_id)).topk_ids
    cluster = Cluster(num_gpus=8, num_nodes=2, num_slots=48, num_groups=m.num_groups, node_limit=2)
    print(f"      EPLB on {cluster.num_gpus} GPUs / {cluster.num_nodes} nodes / {cluster.num_slots} slots, "
          f"node limit {cluster.node_limit}, replayed on the trace's {len(tokens)} tokens:")
    for policy in ("ours", "global", "hierarchical"):
        r = evaluate_policy(policy, weight, tokens, cluster)  # type: ignore[arg-type]
        print(f"        {policy:12s} balancedness even-split {r['balancedness_even']:.3f}, replayed "
              f"{r['balancedness_replay']:.3f}, nodes per token {r['nodes_mean']:.2f} (max {r['nodes_max']})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="r3trace demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
