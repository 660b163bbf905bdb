"""Analysis benchmarks on this 2-core CPU: trace size and write rate, queries in DuckDB / Polars / numpy, EPLB.

Run:   .venv/bin/python -m bench.analysis --rows 100000000 --eplb-ref /tmp/eplbref [--out /tmp/bench]
Smoke: .venv/bin/python -m bench.analysis --smoke   (6 layers: a 20k-row trace, 5 EPLB windows of 256 tokens on 4 nodes)
`--eplb-ref` is a folder holding DeepSeek's eplb.py (github.com/deepseek-ai/EPLB, never committed here);
without it the reference column is skipped. Prints markdown tables for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from r3trace.analysis import agreement, coactivation, heat
from r3trace.analysis.store import TraceStore
from r3trace.analysis.synth import SynthConfig, route_windows, write_synth
from r3trace.eplb import Cluster, churn, cross_node, global_policy, hierarchical, plan
from r3trace.eplb.placement import from_phy2log
from r3trace.eplb.score import balancedness, even_gpu_load, heat_of, node_limited
from r3trace.trace import open_dataset
from r3trace.trace.layout import table_dir

E, K = 256, 8


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def trace_section(out: Path, rows: int, agree_rows: int, layers: int = 61) -> list[str]:
    """layers: the synthetic model's num_hidden_layers (V3's 61, 58 of them MoE; the smoke run takes fewer)."""
    shutil.rmtree(out, ignore_errors=True)
    cfg = SynthConfig(seed=7, num_hidden_layers=layers)
    n_layers = len(cfg.moe_layer_ids)
    dt, w = timed(lambda: write_synth(out / "big", cfg, rows // n_layers, run_id="big", progress=False))
    m = w.manifest
    size = sum(p.stat().st_size for p in (out / "big").rglob("part-*.parquet"))
    lines = [f"- trace: {m.rows / 1e6:.1f}M rows ({m.rows // n_layers:,} tokens x {n_layers} layers x top-{K}) "
             f"in {m.file_count} files, {size / 2**20:.0f} MiB = {size / (m.rows * K):.2f} bytes per expert id",
             f"- synth + write: {dt:.1f} s = {m.rows / dt / 1e6:.2f}M rows/s "
             f"({m.rows * K / dt / 1e6:.1f}M ids/s, generation included)"]
    # two runs of the same tokens for agreement: B flips one expert of ~10% of A's (token, layer) sets
    a_cfg = SynthConfig(seed=11, num_hidden_layers=layers)
    write_synth(out / "agree", a_cfg, agree_rows // n_layers, run_id="A", progress=False)
    ra = open_dataset(out / "agree")[0]
    rng = np.random.default_rng(0)
    dst = out / "agree" / "run_id=B"
    dst.mkdir()
    routes_dst = table_dir(dst, ra.manifest.schema_version, "routes")  # layout 2: <root>/routes/run_id=B
    routes_dst.mkdir(parents=True, exist_ok=True)
    for f in ra.route_files:
        t = pq.read_table(f)
        ids = t.column("topk_ids").combine_chunks().flatten().to_numpy().reshape(-1, K).copy()
        flip = rng.random(len(ids)) < 0.1
        ids[flip, 0] = (ids[flip, 0] + 1 + rng.integers(0, E - 1, flip.sum())) % E  # may collide: rare
        import pyarrow as pa

        t = t.set_column(t.schema.get_field_index("topk_ids"), "topk_ids",
                         pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), K))
        if "run_id" in t.schema.names:  # a layout-1 file carries its run id; layout 2 has it in the path only
            run_b = pa.array(["B"] * t.num_rows).dictionary_encode()
            t = t.set_column(t.schema.get_field_index("run_id"), "run_id", run_b)
        pq.write_table(t, routes_dst / f.name, compression="zstd", compression_level=3)
    from dataclasses import replace

    replace(ra.manifest, run_id="B", files=tuple(replace(x, rollup=None, requests=None) for x in ra.manifest.files)
            ).write(dst)
    store = TraceStore([out / "big", out / "agree"])
    c = store.con
    big_files = [str(p) for p in open_dataset(out / "big")[0].route_files]
    res: dict[str, dict[str, float]] = {}

    def np_ids(files: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids, lay = [], []
        for f in files:
            t = pq.read_table(f, columns=["layer_id", "topk_ids"])
            ids.append(t.column("topk_ids").combine_chunks().flatten().to_numpy().reshape(-1, K))
            lay.append(t.column("layer_id").to_numpy())
        return np.concatenate(lay), np.concatenate(ids)

    # heat
    t_pl, pl_heat = timed(lambda: pl.scan_parquet(big_files, hive_partitioning=False).select("layer_id", "topk_ids")
                          .explode("topk_ids").group_by("layer_id", "topk_ids").len().collect())
    res["heat (L x E counts)"] = {"duckdb": timed(lambda: heat.heat(c, "big"))[0], "polars": t_pl}
    t_np, (lay, ids) = timed(lambda: np_ids(big_files))
    def np_heat() -> np.ndarray:  # [L, E] counts from layer ids (dense layers first: MoE layer 0 is layer 3)
        flat = (((lay.astype(np.int32) - 3) * E)[:, None] + ids).ravel()
        return np.bincount(flat, minlength=n_layers * E).reshape(n_layers, E)

    t_bc, _ = timed(np_heat)
    res["heat (L x E counts)"]["numpy"] = t_np + t_bc
    res["heat from rollups"] = {"duckdb": timed(lambda: heat.heat(c, "big", source="rollups"))[0]}
    res["imbalance (per layer)"] = {"duckdb": timed(lambda: heat.imbalance(c, "big"))[0]}

    def np_imbalance() -> np.ndarray:
        h = np_heat()
        x = np.sort(h, 1).astype(float)
        gini = ((2 * np.arange(1, E + 1) - E - 1) * x).sum(1) / (E * x.sum(1))
        p = x / x.sum(1, keepdims=True)
        ent = -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum(1) / np.log(E)
        return np.stack([x.max(1) / x.mean(1), x.std(1) / x.mean(1), ent, gini])

    res["imbalance (per layer)"]["numpy"] = t_np + timed(np_imbalance)[0]
    res["imbalance (per layer)"]["polars"] = t_pl + timed(  # every expert is selected here, so no zero padding
        lambda: pl_heat.group_by("layer_id").agg(
            (pl.col("len").max() / pl.col("len").mean()).alias("max_over_mean"),
            (pl.col("len").std(ddof=0) / pl.col("len").mean()).alias("cv"),
            (-(pl.col("len") / pl.col("len").sum() * (pl.col("len") / pl.col("len").sum()).log()).sum()
             / np.log(E)).alias("norm_entropy"),
            ((2 * pl.col("len").rank("ordinal") - E - 1) * pl.col("len")).sum() / (E * pl.col("len").sum())))[0]
    co = "co-activation (1 layer, 28 pairs/token)"
    res[co] = {"duckdb": timed(lambda: coactivation.coactivation(c, 30, "big"))[0]}
    one = ids[lay == 30]
    iu, ju = np.triu_indices(K, 1)

    def np_coact() -> np.ndarray:
        a, b = np.minimum(one[:, iu], one[:, ju]), np.maximum(one[:, iu], one[:, ju])
        return np.bincount((a * E + b).ravel(), minlength=E * E)

    res["co-activation (1 layer, 28 pairs/token)"]["numpy"] = timed(np_coact)[0] + t_np / n_layers
    res["co-activation (1 layer, 28 pairs/token)"]["polars"] = timed(
        lambda: pl.scan_parquet(big_files, hive_partitioning=False).filter(pl.col("layer_id") == 30)
        .with_columns(pl.col("topk_ids").cast(pl.List(pl.Int32)))
        .select(pl.concat_list([pl.min_horizontal(pl.col("topk_ids").list.get(int(i)),
                                                  pl.col("topk_ids").list.get(int(j)))
                                * E + pl.max_horizontal(pl.col("topk_ids").list.get(int(i)),
                                                        pl.col("topk_ids").list.get(int(j)))
                                for i, j in zip(iu, ju, strict=True)]).alias("p"))
        .explode("p").group_by("p").len().collect())[0]
    res[f"agreement ({agree_rows / 1e6:.0f}M vs {agree_rows / 1e6:.0f}M rows)"] = {
        "duckdb": timed(lambda: (agreement.agreement_by_layer(c, "A", "B"),
                                 agreement.agreement_summary(c, "A", "B")))[0]}
    summ = agreement.agreement_summary(c, "A", "B").row(0, named=True)
    fa = [str(p) for p in open_dataset(out / "agree")[0].route_files]
    fb = [str(routes_dst / Path(p).name) for p in fa]

    def np_agree() -> float:
        (_, x), (_, y) = np_ids(fa), np_ids(fb)  # same files, same row order: positional match
        inter = (x[:, :, None] == y[:, None, :]).sum((1, 2))
        return float((inter == K).mean())

    res[f"agreement ({agree_rows / 1e6:.0f}M vs {agree_rows / 1e6:.0f}M rows)"]["numpy"] = timed(np_agree)[0]
    res[f"agreement ({agree_rows / 1e6:.0f}M vs {agree_rows / 1e6:.0f}M rows)"]["polars"] = timed(
        lambda: pl.scan_parquet(fa, hive_partitioning=False)
        .select("request_id", "token_pos", "layer_id", pl.col("topk_ids").cast(pl.List(pl.Int32)))
        .join(pl.scan_parquet(fb, hive_partitioning=False).select("request_id", "token_pos", "layer_id",
                                                                  pl.col("topk_ids").cast(pl.List(pl.Int32)).alias("b")),
              on=["request_id", "token_pos", "layer_id"])
        .select((pl.col("topk_ids").list.set_intersection("b").list.len() == K).mean()).collect())[0]
    lines.append(f"- agreement check: exact-match rate {summ['exact_match_rate']:.3f}, tokens with any layer "
                 f"different {summ['tokens_any_layer_different']:.3f} (10% of sets perturbed)")
    lines += ["", "| query | DuckDB s | Polars s | numpy s |", "|---|---|---|---|"]
    for q, r in res.items():
        lines.append(f"| {q} | " + " | ".join(f"{r[k]:.2f}" if k in r else "-" for k in ("duckdb", "polars", "numpy"))
                     + " |")
    lines.append(f"\nnumpy columns include reading the ids from Parquet ({t_np:.1f} s for the big trace); "
                 f"raw heat scan rate in DuckDB {m.rows * K / res['heat (L x E counts)']['duckdb'] / 1e6:.0f}M ids/s.")
    return lines


def load_ref(path: str | None) -> Any:
    """DeepSeek's eplb.py (github.com/deepseek-ai/EPLB, a peer's file fetched beside the project) from the folder
    given by --eplb-ref, run beside ours; None when absent."""
    if not path or not (Path(path) / "eplb.py").exists():
        return None
    spec = importlib.util.spec_from_file_location("eplb_ref", Path(path) / "eplb.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _windows(s: float, n_windows: int, tokens_per_window: int, layers: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic V3 routes at Zipf s -> (routes [W, T, L, K], heat [W, L, E]) of consecutive windows."""
    cfg = SynthConfig(zipf_s=s, seed=3, num_hidden_layers=layers)
    wins = route_windows(cfg, n_windows, tokens_per_window, np.random.default_rng(0))
    return wins, np.stack([heat_of(w, E) for w in wins])


def _diff(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> str:
    """Paired difference of two per-window series: mean +- standard error."""
    d = np.asarray(a) - np.asarray(b)
    return f"{d.mean():+.3f} +- {d.std(ddof=1) / np.sqrt(len(d)):.3f}"


CLUSTERS = "32/4/288,32/4/320,144/18/288"  # GPUs/nodes/slots: DeepSeek-V3's 4-node and 18-node deployments


# (loads [W, L, E], previous placement, newest window's tokens [T, L, K]) -> placement
Policy = Callable[[np.ndarray, Any, np.ndarray], Any]


def _policies(cl: Cluster, ref: Any) -> dict[str, Policy]:
    """The EPLB policies compared on cluster cl, in table order; ref: DeepSeek's eplb module, or None."""
    import torch

    def ref_plan(h: np.ndarray, groups: int = 1, nodes: int = 1) -> Any:
        p2l, _, _ = ref.rebalance_experts(torch.tensor(h), cl.num_slots, groups, nodes, cl.num_gpus)
        return from_phy2log(p2l.numpy(), E)

    pols: dict[str, Policy] = {
        "global (ours)": lambda h, p, t: global_policy(h[-1], cl),
        "cross-node": lambda h, p, t: cross_node(h[-1], cl),
        "r3 planner": lambda h, p, t: plan(h, cl, p, tokens=t),
    }
    if cl.num_groups % cl.num_nodes == 0:
        pols["hierarchical (ours)"] = lambda h, p, t: hierarchical(h[-1], cl)
    if ref is not None:
        pols["DeepSeek ref global"] = lambda h, p, t: ref_plan(h[-1])
        if cl.num_groups % cl.num_nodes == 0:
            pols["DeepSeek ref hierarchical"] = lambda h, p, t: ref_plan(h[-1], 8, cl.num_nodes)
    return pols


def eplb_section(ref: Any, tokens_per_window: int, nodes: tuple[int, ...] = (), n_windows: int = 12,
                 skews: tuple[float, ...] = (0.3, 0.6, 1.0), clusters: str = CLUSTERS, layers: int = 61) -> list[str]:
    """Rolling EPLB comparison: every policy plans at the end of window t (from its previous placement where it
    keeps one) and is scored on window t + 1, for t = 1 .. W - 2; the first plan (windows 0-1, no previous
    placement) is a cold start and is not scored. One held-out window is a noisy judge: the same policy's
    balancedness moves by up to 0.09 from one window to the next at s = 0.3 on 18 nodes (the domain mix of
    the requests in flight), more than the gaps between policies, hence means over W - 3 windows and paired
    differences against the global policy with their standard errors."""
    cl_list = [Cluster(*(int(x) for x in c.split("/"))) for c in clusters.split(",")]
    lines = ["| s | GPUs/nodes/slots | policy | plan s | held-out bal. (even) | vs global | held-out bal. "
             "(node-limited) | vs global | nodes/token mean | > 4 nodes | churn per re-plan (max) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    only = [c for c in cl_list if c.num_nodes in nodes] if nodes else cl_list
    print("\n".join(lines), flush=True)  # rows are printed as they come: the whole section takes ~30 minutes
    for s in skews:
        wins, heats = _windows(s, n_windows, tokens_per_window, layers)
        for cl in only:
            pols = _policies(cl, ref)
            scored: dict[bytes, tuple[float, float, float, float]] = {}  # placement -> scores on its window
            series: dict[str, np.ndarray] = {}
            for name, f in pols.items():
                prev, rows, times, moved = None, [], [], []
                for t in range(1, n_windows - 1):
                    dt, pl_t = timed(partial(f, heats[:t + 1], prev, wins[t]))
                    if prev is not None:
                        times.append(dt)
                        moved.append(churn(prev, pl_t))
                        key = pl_t.phy2log.tobytes() + bytes([t])  # the reference repeats ours: score once
                        if key not in scored:
                            d = node_limited(pl_t, wins[t + 1], cl)
                            scored[key] = (balancedness(even_gpu_load(pl_t, heats[t + 1], cl)),
                                           balancedness(d.gpu_load), float(d.nodes.mean()),
                                           float((d.nodes > 4).mean()))
                        rows.append(scored[key])
                    prev = pl_t
                series[name] = r = np.array(rows)  # [W - 3, 4]
                g = series["global (ours)"]
                lines.append(
                    f"| {s} | {cl.num_gpus}/{cl.num_nodes}/{cl.num_slots} | {name} | {np.median(times):.3f} | "
                    f"{r[:, 0].mean():.3f} | {_diff(r[:, 0], g[:, 0])} | {r[:, 1].mean():.3f} | "
                    f"{_diff(r[:, 1], g[:, 1])} | {r[:, 2].mean():.2f} | {r[:, 3].mean():.1%} | "
                    f"{np.mean(moved):.1%} ({np.max(moved):.1%}) |")
                print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000_000)
    ap.add_argument("--agree-rows", type=int, default=10_000_000)
    ap.add_argument("--eplb-ref", default=None)
    ap.add_argument("--window-tokens", type=int, default=16384)
    ap.add_argument("--eplb-windows", type=int, default=12, help="consecutive windows of the rolling EPLB run")
    ap.add_argument("--eplb-s", type=float, nargs="*", default=[0.3, 0.6, 1.0], help="Zipf skews of the EPLB run")
    ap.add_argument("--out", default="/tmp/r3trace-bench")
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--eplb-nodes", type=int, nargs="*", default=[], help="only clusters with these node counts")
    ap.add_argument("--eplb-clusters", default=CLUSTERS, help="GPUS/NODES/SLOTS,... of the EPLB run")
    ap.add_argument("--layers", type=int, default=61, help="the synthetic model's layers (V3: 61, 58 of them MoE)")
    ap.add_argument("--smoke", action="store_true", help="a tiny trace in a temporary folder, tiny EPLB windows")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.agree_rows, args.window_tokens, args.eplb_windows = 20_000, 5_000, 256, 5
        args.eplb_s, args.eplb_clusters, args.layers = [0.6], "32/4/288", 6
    if not args.skip_trace:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) if args.smoke else Path(args.out)
            print("\n".join(trace_section(out, args.rows, args.agree_rows, args.layers)), flush=True)
    ref = load_ref(args.eplb_ref)
    if ref is None:
        print("(DeepSeek reference not given: its columns are skipped)")
    eplb_section(ref, args.window_tokens, tuple(args.eplb_nodes), args.eplb_windows, tuple(args.eplb_s),
                 args.eplb_clusters, args.layers)


if __name__ == "__main__":
    main()
