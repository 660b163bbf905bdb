"""Bytes each collective moves per layer: computed from the layout (`collective_bytes`), measured on gloo ranks.

Run (CPU): .venv/bin/python -m bench.collective_bytes --out bench/results/collective_bytes-cpu.json
           .venv/bin/python -m bench.collective_bytes --markdown bench/results/collective_bytes-cpu.json
Smoke:     .venv/bin/python -m bench.collective_bytes --smoke   (the tables of the committed result file)

The formula, its byte rules and shape legend: bench/collective_model.py. Measured: the wrappers below replace
torch.distributed's collectives in each rank process and read the tensors' sizes and split sizes of every call (wire
is then derived with the same algorithm formulas: gloo does not report what it puts on a socket). Calls are
attributed to a layer by a forward pre-hook on each decoder layer and to a stage by the engine function on the call
stack (prepare_mlp, dispatch, ...); the engine is not changed.

The normal-mode all-to-all's bytes depend on the routes: computed from the routes the dispatcher really got (equal to
the measured count, checked per layer and rank), the expectation under uniform routing, and the worst case per rank.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.collective_model import Collective, Layout, Mode, RankRows, Shape, collective_bytes
from r3trace.capture.recorder import ListRecorder
from r3trace.engine.model_config import ModelConfig

MODEL = Path(__file__).resolve().parent.parent / "samples" / "model"


# ---- measurement: counting wrappers in each rank process ----------------------------------------------------------
STAGES = {"prepare_mlp": "prepare_mlp", "postprocess_layer": "postprocess_layer", "_gather_routes": "route_gather",
          "dispatch": "dispatch", "combine": "combine", "reduce_embedding": "embed", "gather_logits": "logits",
          "gather_dp_layout": "dp_layout", "_gather_plan": "replay_plan"}  # fmt: skip
# every collective the engine could call; one without a byte formula below fails the run rather than go uncounted
WRAPPED = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_to_all_single",
           "all_to_all", "reduce_scatter", "reduce_scatter_tensor", "broadcast")  # fmt: skip


class Counter:
    """Wraps torch.distributed's collectives in this process; records (step, layer, Collective) per call."""

    def __init__(self, parallel: Any) -> None:
        self.groups = {id(getattr(parallel, f"{n}_group")): n for n in ("cpu", "ep", "dp", "attn_tp", "tp")}
        self.step = ""  # "prefill" | "decode", set by the caller before each forward
        self.layer: int | None = None  # the decoder layer running (None: outside the layers)
        self.records: list[dict[str, Any]] = []
        self.routes: dict[str, dict[int, list[int]]] = {}  # step -> layer -> rows sent to each EP rank

    def install(self, model: Any) -> None:
        for name in WRAPPED:
            if hasattr(dist, name):  # torch 2.11 has no all_gather_single (engine/distributed.all_gather_into)
                setattr(dist, name, self._wrap(name, getattr(dist, name)))
        for layer in model.decoder_layers():
            layer.register_forward_pre_hook(lambda _m, _i, lid=layer.layer_id: setattr(self, "layer", lid))
            layer.register_forward_hook(lambda *_: setattr(self, "layer", None))
        from r3trace.engine.layers.dispatcher import AllToAllDispatcher

        original = AllToAllDispatcher.dispatch

        def dispatch(disp: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Any:
            per_rank = disp.num_experts // disp.ep_size
            dest = topk_ids.long() // per_rank  # [n, K] the EP rank of each pair
            send = [int((dest == j).any(1).sum()) for j in range(disp.ep_size)]  # a token counts once per rank
            self.routes.setdefault(self.step, {})[int(self.layer)] = send  # type: ignore[arg-type]
            return original(disp, x, topk_ids, topk_weights)

        AllToAllDispatcher.dispatch = dispatch  # type: ignore[method-assign]

    def _stage(self) -> str:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_name in STAGES and "/engine/" in f.f_code.co_filename:
                return STAGES[f.f_code.co_name]
            f = f.f_back  # type: ignore[assignment]
        return "other"

    def _wrap(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        def counted(*args: Any, **kwargs: Any) -> Any:
            a = sig.bind(*args, **kwargs).arguments
            group = a.get("group")
            r, me = dist.get_world_size(group), dist.get_rank(group)
            if op == "all_reduce":
                c = ("all_reduce", a["tensor"].nbytes, a["tensor"].nbytes, 2 * (r - 1) * a["tensor"].nbytes / r)
            elif op == "all_gather":
                x = a["tensor"].nbytes
                c = ("all_gather", x, sum(t.nbytes for t in a["tensor_list"]), (r - 1) * x)
            elif op in ("all_gather_single", "all_gather_into_tensor"):
                x = a["input_tensor"].nbytes if "input_tensor" in a else list(a.values())[1].nbytes
                out = a["output_tensor"].nbytes if "output_tensor" in a else list(a.values())[0].nbytes
                c = ("all_gather", x, out, (r - 1) * x)
            elif op == "all_to_all_single":
                x, out = a["input"], a["output"]
                splits = a.get("input_split_sizes")
                rows = x.shape[0]
                kept = (splits[me] if splits else rows // r) * (x.nbytes // rows if rows else 0)
                c = ("all_to_all", x.nbytes, out.nbytes, x.nbytes - kept)
            else:
                raise RuntimeError(f"the engine called dist.{op}: this bench has no byte formula for it")
            gname = "world" if group is None else self.groups.get(id(group), "?")
            self.records.append(dict(step=self.step, layer=self.layer, **Collective(self._stage(), c[0], gname, r,
                                                                                    *c[1:])._asdict()))  # fmt: skip
            return fn(*args, **kwargs)

        return counted


# ---- the rank processes --------------------------------------------------------------------------------------------
DECODE_B, PREFILL_T = 8, 64  # decode batch and prefill tokens per DP rank (8 requests x 8 tokens)


def _batch(step: str, r2t: torch.Tensor, vocab: int, parallel: Any, forward_id: int) -> Any:
    from r3trace.engine.dp_layout import gather_dp_layout
    from r3trace.engine.forward_batch import ForwardBatch

    b, per = DECODE_B, PREFILL_T // DECODE_B
    gen = torch.Generator().manual_seed(1 + parallel.dp_rank)
    if step == "prefill":
        ids, pre, ext, loc = torch.randint(2, vocab, (PREFILL_T,), generator=gen), [0] * b, [per] * b, r2t[:, :per]
        rows = [(i + 1) * per - 1 for i in range(b)]
    else:
        ids, pre, ext, loc, rows = torch.randint(2, vocab, (b,), generator=gen), [per] * b, [1] * b, r2t[:, per], None
    fb = ForwardBatch.build(forward_id=forward_id, input_ids=ids.tolist(), prefix_lens=pre, extend_lens=ext,
                            req_pool_indices=list(range(b)), out_cache_loc=loc.reshape(-1), req_to_token=r2t,
                            logits_rows=rows or list(range(b)), device="cpu")  # fmt: skip
    if parallel.dp_size > 1:
        fb.dp_layout = gather_dp_layout(len(ids), parallel, "sum" if step == "prefill" else "max")
        fb.dp_rank = parallel.dp_rank
    return fb


def measure_rank(rank: int, world: int, dp: int, ep: int, options: dict[str, Any], port: int, model_dir: str,
                 out_dir: str) -> None:  # fmt: skip
    """One rank: the model of model_dir, a prefill of 64 tokens then a decode step of 8, every collective counted."""
    from datetime import timedelta

    from r3trace.engine.distributed import init_parallel
    from r3trace.engine.engine_config import EngineConfig
    from r3trace.engine.model import build_model, moe_rows_per_rank
    from r3trace.engine.weights import load_weights

    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)  # fmt: skip
    try:
        parallel = init_parallel(world, dp, ep, timeout=timeout)
        ecfg = EngineConfig(chunked_prefill_size=PREFILL_T, max_running_requests=DECODE_B, **options)
        cfg = ModelConfig.from_hf(model_dir)
        model = build_model(cfg, ecfg, parallel, ListRecorder())  # capture on: routes gathered where the engine does
        load_weights(model, model_dir)
        counter = Counter(parallel)
        counter.install(model)
        per = PREFILL_T // DECODE_B
        r2t = torch.arange(DECODE_B * (per + 1), dtype=torch.int32).view(DECODE_B, per + 1)
        kv = torch.zeros(cfg.num_hidden_layers, r2t.numel(), cfg.kv_cache_dim, dtype=ecfg.torch_dtype)
        for i, step in enumerate(("prefill", "decode")):
            counter.step = step
            fb = _batch(step, r2t, cfg.vocab_size, parallel, i)
            model(fb, kv)
        result = dict(records=counter.records, routes=counter.routes, ep_rank=parallel.ep_rank,
                      ll_rows=moe_rows_per_rank(ecfg, parallel), dtype_bytes=ecfg.torch_dtype.itemsize)  # fmt: skip
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()



# ---- computed vs measured ------------------------------------------------------------------------------------------
STEPS: dict[str, tuple[int, Mode, int]] = {
    "decode": (DECODE_B, "max", DECODE_B),
    "prefill": (PREFILL_T, "sum", DECODE_B),
}
CONFIGS: dict[str, tuple[int, int, int, dict[str, Any]]] = {  # name -> (tp, dp, ep, EngineConfig options)
    "tp2": (2, 1, 1, {}),
    "dp2": (2, 2, 1, {}),
    "ep2": (2, 1, 2, {"deepep_mode": "normal"}),
    "ep2_low_latency": (2, 1, 2, {"deepep_mode": "low_latency"}),
    "dp2_ep2": (2, 2, 2, {"deepep_mode": "normal"}),
    "tp4_dp2_ep2": (4, 2, 2, {"deepep_mode": "normal"}),
    "tp2_exact": (2, 1, 1, {"deterministic": True}),
    "dp2_ep2_exact": (2, 2, 2, {"deterministic": True}),  # exact mode's dispatcher: low_latency
}


def measure(tp: int, dp: int, ep: int, options: dict[str, Any], model_dir: Path, out_dir: Path) -> list[dict[str, Any]]:
    """Spawn tp gloo ranks (bench/spawn.py) and return each rank's counted calls and routes."""
    from bench.collective_bytes import measure_rank as rank_fn  # by module name: run as a script, this is __main__
    from bench.spawn import free_port, spawn_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out_dir.mkdir(parents=True, exist_ok=True)
    spawn_ranks(rank_fn, (tp, dp, ep, options, free_port(), str(model_dir), str(out_dir)), tp)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(tp)]


def _values(c: Collective) -> list[float]:
    return [c.sent, c.received, c.wire]


def compare(cfg: ModelConfig, tp: int, dp: int, ep: int, options: dict[str, Any],
            ranks: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """Every rank's calls, layer by layer, against collective_bytes (normal-mode all-to-alls: fed the real routes)."""
    shape, exact = Shape.of(cfg), bool(options.get("deterministic"))
    mode = "low_latency" if exact or options.get("deepep_mode") == "low_latency" else "normal"
    layout = Layout(tp, dp, ep, mode, ranks[0]["ll_rows"])  # type: ignore[arg-type]
    b, moe_ids = ranks[0]["dtype_bytes"], set(cfg.moe_layer_ids)
    moe_tp = tp // ep
    mismatches: list[str] = []
    steps: dict[str, Any] = {}
    for step, (t, dp_mode, logit_rows) in STEPS.items():
        base = collective_bytes(shape, layout, t, dp_mode, b, exact, logit_rows=logit_rows)
        measured: dict[str, list[list[list[float]]]] = {"dense": [], "moe": [], "forward": []}  # kind -> [call][obs]
        for rank, res in enumerate(ranks):
            calls = [rec for rec in res["records"] if rec["step"] == step]
            for lid in [None, *range(cfg.num_hidden_layers)]:
                got = [Collective(**{f: rec[f] for f in Collective._fields}) for rec in calls if rec["layer"] == lid]
                kind = "forward" if lid is None else "moe" if lid in moe_ids else "dense"
                want = getattr(base, kind)
                if kind == "moe" and ep > 1 and mode == "normal":
                    peers = [ranks[j] for j in range(rank % moe_tp, tp, moe_tp)]  # the EP group, in EP rank order
                    me = res["ep_rank"]
                    send = res["routes"][step][str(lid)]
                    recv = [peer["routes"][step][str(lid)][me] for peer in peers]
                    want = collective_bytes(shape, layout, t, dp_mode, b, exact, RankRows(tuple(send), tuple(recv), me),
                                            logit_rows).moe  # fmt: skip
                if got != want:
                    mismatches.append(f"{step} rank {rank} layer {lid}: measured {got}, computed {want}")
                slots = measured[kind]
                for i, c in enumerate(got):
                    if len(slots) <= i:
                        slots.append([])
                    slots[i].append(_values(c))
        uniform = collective_bytes(shape, layout, t, dp_mode, b, exact, "uniform", logit_rows)
        worst = collective_bytes(shape, layout, t, dp_mode, b, exact, "worst", logit_rows)
        entry: dict[str, Any] = {}
        for kind in ("moe", "dense", "forward"):
            rows = []
            for i, c in enumerate(getattr(uniform, kind)):
                obs = measured[kind][i] if i < len(measured[kind]) else []
                rows.append(dict(stage=c.stage, op=c.op, group=c.group, ranks=c.ranks,
                                 computed=_values(c), worst=_values(getattr(worst, kind)[i]),
                                 measured_mean=[sum(v[j] for v in obs) / len(obs) for j in range(3)] if obs else None,
                                 measured_min=[min(v[j] for v in obs) for j in range(3)] if obs else None,
                                 measured_max=[max(v[j] for v in obs) for j in range(3)] if obs else None))  # fmt: skip
            entry[kind] = rows
        steps[step] = entry
    return dict(tp=tp, dp=dp, ep=ep, options=options, layout=asdict(layout), dtype_bytes=b,
                match=not mismatches, mismatches=mismatches[:20], steps=steps)  # fmt: skip


# ---- report ---------------------------------------------------------------------------------------------------------
TENSORS = {("dispatch", "normal"): ["counts [G] int64", "ids + weights [N, 2K] int32", "hidden [N, D]"],
           ("dispatch", "low_latency"): ["counts [E] int64", "rows [E M, D]"], ("combine", "normal"): ["rows [Q, D]"],
           ("combine", "low_latency"): ["rows [E M, D]"], ("route_gather", ""): ["ids + weights [n, 2K] int32"],
           ("postprocess_layer", "scattered"): ["hidden [n, D]", "residual [n, D]"]}  # fmt: skip


def labels(calls: list[Any], dispatcher: str) -> list[str]:
    """Human names of one layer's calls, in order: stage, tensor, op over group (ranks)."""
    out, seen = [], {}  # type: ignore[var-annotated]
    for c in calls:
        stage, op = (c.stage, c.op) if isinstance(c, Collective) else (c["stage"], c["op"])
        group, r = (c.group, c.ranks) if isinstance(c, Collective) else (c["group"], c["ranks"])
        i = seen.get(stage, 0)
        seen[stage] = i + 1
        key = (stage, dispatcher if stage in ("dispatch", "combine") else "scattered" if group == "attn_tp" and
               op == "all_gather" and stage == "postprocess_layer" else "")  # fmt: skip
        tensor = TENSORS.get(key, [""] * 4)[i] if key in TENSORS else ""
        out.append(f"{stage}{': ' + tensor if tensor else ''}, {op} over {group} ({r})")
    return out


def human(x: float) -> str:
    if x == 0:
        return "0"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if x >= size:
            return f"{x / size:.4g} {unit}"
    return f"{x:.4g} B" if x != int(x) else f"{int(x)} B"


def _triple(v: list[float]) -> str:
    return " / ".join(human(x) for x in v)


def markdown(result: dict[str, Any]) -> str:
    """One table per measured layout (per MoE layer, per rank), then the computed-only shapes."""
    lines = []
    for name, c in result["configs"].items():
        lay = c["layout"]
        desc = f"tp {c['tp']}, dp {c['dp']}, ep {c['ep']}, attention TP {c['tp'] // c['dp']}"
        if c["ep"] > 1:
            desc += f", {lay['dispatcher']}" + (f", M {lay['ll_rows']}" if lay["dispatcher"] == "low_latency" else "")
        desc += ", exact" if c["options"].get("deterministic") else ""
        lines += ["", f"**{name}** ({desc}): computed == measured on every layer and "
                  f"rank: **{'yes' if c['match'] else 'NO'}**", "",
                  "| step | collective | computed sent / received / wire | measured (mean over ranks, MoE layers) |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        for step, e in c["steps"].items():
            for label, row in zip(labels(e["moe"], c["layout"]["dispatcher"]), e["moe"], strict=True):
                routed = row["stage"] in ("dispatch", "combine") and c["layout"]["dispatcher"] == "normal" \
                    and row["computed"] != row["worst"]  # fmt: skip
                comp = _triple(row["computed"]) + (f" (uniform; worst {_triple(row['worst'])})" if routed else "")
                meas = _triple(row["measured_mean"]) if row["measured_mean"] else "none"
                if routed:
                    meas += f" (= computed from the real routes; ranks x layers {human(row['measured_min'][0])}" \
                            f" .. {human(row['measured_max'][0])} sent)"  # fmt: skip
                lines.append(f"| {step} | {label} | {comp} | {meas} |")
    return "\n".join(lines)


SHAPES_COMPUTED: dict[str, tuple[Shape, int, int]] = {  # name -> (shape, layers, dense layers)
    "v3-2.5b": (Shape(hidden=2048, vocab=32000, experts=64, top_k=6, n_group=8, topk_group=4), 12, 1),
    "DeepSeek-V3": (Shape(hidden=7168, vocab=129280, experts=256, top_k=8, n_group=8, topk_group=4), 61, 3),
}
LAYOUTS_COMPUTED: dict[str, Layout] = {
    "tp2": Layout(2),
    "dp2": Layout(2, 2),
    "ep2": Layout(2, 1, 2),
    "ep2 low_latency": Layout(2, 1, 2, "low_latency"),
    "dp2+ep2": Layout(2, 2, 2),
    "tp4 dp2 ep2": Layout(4, 2, 2),
    "tp8 dp8 ep8": Layout(8, 8, 8),
    "tp8 dp8 ep8 low_latency": Layout(8, 8, 8, "low_latency"),
}


def computed_markdown(decode: int = 64, prefill: int = 4096, dtype_bytes: int = 2) -> str:
    """Per MoE layer, per rank, bf16 activations: computed, not measured. Low-latency M = the step's rows (n)."""
    lines = []
    for sname, (shape, _, _) in SHAPES_COMPUTED.items():
        lines += ["", f"**{sname}** (D {shape.hidden}, E {shape.experts}, top-{shape.top_k}, groups "
                  f"{shape.topk_group} of {shape.n_group}), bf16, per MoE layer, per rank, computed, not measured:", "",
                  f"| layout | collective | decode {decode}: sent / wire | prefill {prefill}: sent / wire |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        for lname, lay in LAYOUTS_COMPUTED.items():
            per = {}
            for step, t, mode in (("decode", decode, "max"), ("prefill", prefill, "sum")):
                lay_t = Layout(lay.tp, lay.dp, lay.ep, lay.dispatcher, -(-t // lay.attn_tp))
                per[step] = [collective_bytes(shape, lay_t, t, mode, dtype_bytes, routes=rt).moe  # type: ignore[arg-type]
                             for rt in ("uniform", "worst")]  # fmt: skip
            for i, label in enumerate(labels(per["decode"][0], lay.dispatcher)):
                cells = []
                for step in ("decode", "prefill"):
                    u, w = per[step][0][i], per[step][1][i]
                    cell = f"{human(u.sent)} / {human(u.wire)}"
                    if (u.sent, u.wire) != (w.sent, w.wire):
                        cell += f" (worst {human(w.sent)} / {human(w.wire)})"
                    cells.append(cell)
                lines.append(f"| {lname} | {label} | {cells[0]} | {cells[1]} |")
            tot = [sum(c.wire for c in per[s][0]) for s in ("decode", "prefill")]
            lines.append(f"| {lname} | **total wire** | {human(tot[0])} | {human(tot[1])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--markdown", type=Path, help="print the tables of a result file and the computed ones")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--smoke", action="store_true", help="the tables of the committed result file, no ranks (make "
                    "test; tests/engine/test_collective_bytes.py runs the ranks)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.smoke:
        args.markdown = MODEL.parents[1] / "bench" / "results" / "collective_bytes-cpu.json"
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        print(computed_markdown())
        return
    import tempfile

    cfg = ModelConfig.from_hf(MODEL)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            tp, dp, ep, options = CONFIGS[name]
            ranks = measure(tp, dp, ep, options, MODEL, Path(tmp) / name)
            results[name] = compare(cfg, tp, dp, ep, options, ranks)
            print(name, "computed == measured" if results[name]["match"] else results[name]["mismatches"][:3],
                  flush=True)  # fmt: skip
    out = dict(model="samples/model", hardware="CPU, gloo", torch=torch.__version__, decode_batch=DECODE_B,
               prefill_tokens=PREFILL_T, definitions=__doc__, configs=results)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
