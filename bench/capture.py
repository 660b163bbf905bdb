"""Capture overhead, wire-format throughput and trace-sink throughput.

Run (GPU):   python -m bench.capture --device cuda --out capture.json
Run (CPU, wire + sink only): python -m bench.capture --device cpu --parts wire,sink
Smoke (CPU): python -m bench.capture --smoke   (every part at tiny sizes, decode at batch 1 and 3, ref backends)

Decode-step time with route capture on (every request asks) vs off, on a random model with DeepSeek-V3
routing dims (E=256, K=8, 8 groups, top-4 groups) at batch 1, 64 and 256; capture's own host syncs are
counted with torch.cuda.set_sync_debug_mode("error") around every capturer call. A step is timed as the
engine runs it: launch, capture hooks, then a wait on the main stream (the engine's wait for its sampled
tokens); the capture copy runs on its own stream and its host scatter happens two steps later inside
on_forward_end, while the GPU runs that step. `graph_breakdown` prices each part with the GPU idle.
Wire: base64 encode and decode of a 32k-token x 58-layer x top-8 route array with pybase64 vs the
standard library, same run. Sink: tokens/s through TraceWriter and bytes per token on disk.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.timing import replays_ms
from r3trace.capture.capturer import CaptureConfig, RoutedExpertsCapturer
from r3trace.capture.recorder import NullRecorder
from r3trace.engine.engine_config import EngineConfig
from r3trace.engine.forward_batch import ForwardBatch
from r3trace.engine.model import DeepseekForCausalLM, build_model
from r3trace.engine.model_config import ModelConfig
from r3trace.engine.parallel import ParallelInfo


def v3_routing_config(layers: int, hidden: int = 2048, experts: int = 256) -> ModelConfig:
    """DeepSeek-V3 routing and MLA dims (E = 256, K = 8, 8 groups, top-4 groups, kv_lora 512 + 64), hidden
    2048 instead of 7168 so that V3's 61 layers fit one GPU (58 MoE layers: 47 GB of bf16 experts). The smoke
    run shrinks hidden and E."""
    return ModelConfig.from_dict(dict(
        model_type="deepseek_v3", vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=2 * hidden, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=256,
        n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=3 if layers > 8 else 1, max_position_embeddings=4096,
    ), name="bench-v3-routing")


def random_model(cfg: ModelConfig, ecfg: EngineConfig, recorder: Any) -> DeepseekForCausalLM:
    model = build_model(cfg, ecfg, ParallelInfo(), recorder)
    gen = torch.Generator(device=ecfg.device).manual_seed(0)  # init where the weights live: GBs of them
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
    model.post_load()
    return model


class _SyncChecked:
    """Wraps a capturer: every call runs under set_sync_debug_mode('error') (a host sync raises)."""

    def __init__(self, inner: RoutedExpertsCapturer) -> None:
        self.inner = inner

    def _guard(self, fn: Any, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def on_forward_begin(self, batch: Any) -> None:
        self._guard(self.inner.on_forward_begin, batch)

    def route_buffer(self, layer_id: int, num_tokens: int, row0: int = 0) -> torch.Tensor | None:
        return self.inner.route_buffer(layer_id, num_tokens, row0)

    def capture(self, layer_id: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                row0: int = 0) -> None:
        self._guard(self.inner.capture, layer_id, topk_ids, topk_weights, row0)

    def on_forward_end(self, batch: Any) -> None:
        self._guard(self.inner.on_forward_end, batch)


def set_recorder(model: DeepseekForCausalLM, recorder: Any) -> None:
    """Bench only: swap the injected recorder so one set of weights serves both runs."""
    model.recorder = recorder
    for layer in model.model.layers:
        if layer.is_moe:
            layer.mlp.gate.recorder = recorder


ROW_INVARIANT: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


def decode_step_times(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = v3_routing_config(args.layers, args.hidden, args.experts)
    backend = "triton" if args.device == "cuda" else "ref"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    ecfg = EngineConfig(dtype=str(dtype).removeprefix("torch."), device=args.device, attention_backend=backend,
                        moe_backend=backend, topk_backend=backend, norm_backend=backend, rope_backend=backend,
                        kv_pool_tokens=max(args.batches) * args.context, chunked_prefill_size=512,
                        max_running_requests=max(args.batches), row_invariant=ROW_INVARIANT[args.row_invariant])
    model = random_model(cfg, ecfg, NullRecorder())
    slots = ecfg.kv_pool_tokens
    # slots + 1: the last row is the padding slot CUDA-graph decode writes its padding rows to
    kv = torch.randn(cfg.num_hidden_layers, slots + 1, cfg.kv_cache_dim, dtype=dtype, device=args.device)
    kv *= 0.1
    capturer = RoutedExpertsCapturer(CaptureConfig(
        num_hidden_layers=cfg.num_hidden_layers, moe_layer_ids=cfg.moe_layer_ids, top_k=8, num_experts=args.experts,
        kv_slots=slots, max_batch_tokens=max(512, max(args.batches)), chunked_prefill_size=512,
        max_running_requests=max(args.batches), device=args.device,
    ))
    rows = []
    for b in args.batches:
        r2t = torch.arange(b * args.context, dtype=torch.int32, device=args.device).view(b, args.context)
        fb = ForwardBatch.build(
            forward_id=0, input_ids=list(range(7, 7 + b)), prefix_lens=[args.context - 1] * b, extend_lens=[1] * b,
            req_pool_indices=list(range(b)), out_cache_loc=r2t[:, -1].long(), req_to_token=r2t,
            logits_rows=list(range(b)), device=args.device, request_ids=[f"r{i}" for i in range(b)],
            phases=["decode"] * b,
        )
        for i in range(b):
            capturer.add_request(f"r{i}", want=True)
        result: dict[str, Any] = {"batch": b, "context": args.context, "layers": args.layers}
        if args.device == "cuda":
            # One forward with every capturer call under sync-debug "error" (a host sync raises). Timed runs
            # use the bare capturer: the wrapper's mode switches cost ~10 us per call, 58 calls a forward.
            set_recorder(model, _SyncChecked(capturer))
            model(fb, kv)
            torch.cuda.synchronize()
            result["host_syncs_in_capture"] = 0
        recorders = {"off": NullRecorder(), "on": capturer}
        times: dict[str, list[float]] = {"off": [], "on": []}
        # Off and on alternate step by step, so clock and thermal drift hit both alike.
        for it in range(args.warmup + args.iters):
            for mode in ("off", "on"):
                set_recorder(model, recorders[mode])
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(fb, kv)  # as in the engine: the forward's end drains the copy of two steps ago
                if args.device == "cuda":
                    torch.cuda.current_stream().synchronize()  # the engine's wait for its sampled tokens
                if it >= args.warmup:
                    times[mode].append(time.perf_counter() - t0)
        result.update(summarise(times, "eager"))
        if args.graphs:
            graph_times, breakdown = graph_step_times(args, model, kv, fb, capturer, b, recorders)
            result.update(summarise(graph_times, "graph"))
            result["graph_breakdown"] = breakdown
            print(f"decode B={b:4d} graph breakdown: {json.dumps(breakdown)}", flush=True)
        result["bytes_copied_per_step"] = capturer.bytes_last_step
        rows.append(result)
        for mode in ("eager", "graph") if args.graphs else ("eager",):
            print(f"decode B={b:4d} {mode:5s}: off {result[f'{mode}_ms_off']:8.3f} ms (IQR "
                  f"{result[f'{mode}_ms_off_iqr']:.3f})  on {result[f'{mode}_ms_on']:8.3f} ms  overhead "
                  f"{result[f'{mode}_overhead_pct']:+.2f}%  copied {capturer.bytes_last_step} B/step", flush=True)
    return rows


def summarise(times: dict[str, list[float]], mode: str) -> dict[str, float]:
    off, on = (1e3 * statistics.median(times[m]) for m in ("off", "on"))
    q = statistics.quantiles(times["off"], n=4)
    return {f"{mode}_ms_off": off, f"{mode}_ms_on": on, f"{mode}_ms_off_iqr": 1e3 * (q[2] - q[0]),
            f"{mode}_overhead_pct": 100 * (on - off) / off}


def graph_step_times(args: argparse.Namespace, model: Any, kv: torch.Tensor, fb: ForwardBatch,
                     capturer: RoutedExpertsCapturer, b: int, recorders: dict[str, Any]
                     ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """The same decode step replayed from CUDA graphs: one graph captured with capture off (NullRecorder),
    one with the capturer writing inside the graph; its host copy runs after the replay, as in the engine."""
    from r3trace.engine.cuda_graph import DecodeGraphs

    graphs = {}
    for mode in ("off", "on"):
        set_recorder(model, NullRecorder() if mode == "off" else capturer)
        graphs[mode] = DecodeGraphs(model, kv, fb.req_to_token, (b,), args.context, kv.shape[1] - 1)
    times: dict[str, list[float]] = {"off": [], "on": []}
    checked = _SyncChecked(capturer)
    for it in range(args.warmup + args.iters):
        for mode in ("off", "on"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if mode == "on":
                (checked if it == 0 else recorders["on"]).on_forward_begin(fb)
            graphs[mode].run(fb)
            if mode == "on":
                # as in the engine, the host scatter of the copy of two steps ago runs here, while the GPU
                # runs this step; the first step runs under sync-debug "error" (a host sync would raise)
                (checked if it == 0 else recorders["on"]).on_forward_end(fb)
            torch.cuda.current_stream().synchronize()  # the engine's wait for its sampled tokens
            if it >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
    return times, capture_breakdown(graphs, fb, capturer, b)


def capture_breakdown(graphs: dict[str, Any], fb: ForwardBatch, capturer: RoutedExpertsCapturer, b: int
                      ) -> dict[str, float]:
    """Where capture's cost sits: GPU time of each graph alone (CUDA events over 20 back-to-back replays),
    and the host time of the capturer's calls with the GPU idle (so nothing else is in the number)."""
    out: dict[str, float] = {}
    for mode, g in graphs.items():
        out[f"replay_gpu_ms_{mode}"] = replays_ms(g.graphs[b][0])  # DecodeGraphs keeps (replay, logits) a batch size
    host: dict[str, list[float]] = {"begin_end_ms": [], "copy_gpu_ms": [], "drain_ms": []}
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        capturer.on_forward_begin(fb)
        ev0 = torch.cuda.Event(enable_timing=True)
        ev0.record()
        capturer.on_forward_end(fb)  # queues the gather and the device-to-host copy
        ev1 = torch.cuda.Event(enable_timing=True)
        ev1.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        capturer.drain()  # the copy is complete: only the host scatter is left
        host["begin_end_ms"].append(1e3 * (t1 - t0))
        host["copy_gpu_ms"].append(ev0.elapsed_time(ev1))
        host["drain_ms"].append(1e3 * (time.perf_counter() - t2))
    out.update({k: statistics.median(v) for k, v in host.items()})
    return out


def wire_throughput(tokens: int = 32768, layers: int = 58, k: int = 8) -> dict[str, float]:
    import pybase64

    ids = np.random.default_rng(0).integers(0, 256, size=(tokens, layers, k), dtype=np.int32)
    raw = ids.astype("<i4").tobytes()
    out: dict[str, float] = {"payload_mb": len(raw) / 1e6}
    for name, enc, dec in (("pybase64", pybase64.b64encode, pybase64.b64decode),
                           ("stdlib", base64.b64encode, base64.b64decode)):
        encoded = enc(raw)
        t_enc = min(_timeit(lambda: enc(raw)) for _ in range(3))  # noqa: B023
        t_dec = min(_timeit(lambda: dec(encoded)) for _ in range(3))  # noqa: B023
        out[f"{name}_encode_mb_s"] = len(raw) / 1e6 / t_enc
        out[f"{name}_decode_mb_s"] = len(raw) / 1e6 / t_dec
    out["encode_ratio"] = out["pybase64_encode_mb_s"] / out["stdlib_encode_mb_s"]
    out["decode_ratio"] = out["pybase64_decode_mb_s"] / out["stdlib_decode_mb_s"]
    print("wire:", json.dumps({k_: round(v, 1) for k_, v in out.items()}), flush=True)
    return out


def sink_throughput(tokens: int = 200_000, layers: int = 58, k: int = 8) -> dict[str, float]:
    from r3trace.trace.writer import TraceWriter

    rng = np.random.default_rng(1)
    # Zipf-skewed ids, like a trained router's, so compression is not flattered by uniform noise.
    ids = (rng.zipf(1.3, size=(tokens, layers, k)) % 256).astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        with TraceWriter(tmp, model_name="bench", num_hidden_layers=layers + 3, moe_layer_ids=range(3, layers + 3),
                         num_experts=256, top_k=k) as w:
            step = 4096
            for s in range(0, tokens, step):
                n = min(step, tokens - s)
                w.append_tokens([f"req{(s + i) // 1024}" for i in range(n)], np.arange(s, s + n) % 1024, "decode",
                                "computed", s // step, time.time_ns(), 0, ids[s : s + n])
        dt = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in Path(tmp).rglob("part-*.parquet"))
    out = {"tokens": tokens, "tokens_per_s": tokens / dt, "bytes_per_token": size / tokens,
           "bytes_per_expert_id": size / (tokens * layers * k)}
    print("sink:", json.dumps({k_: round(v, 3) for k_, v in out.items()}), flush=True)
    return out


def _timeit(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--parts", default="decode,wire,sink")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--layers", type=int, default=61)  # DeepSeek-V3: 61 layers, 58 of them MoE
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="skip the CUDA-graph timing")
    ap.add_argument("--row-invariant", choices=tuple(ROW_INVARIANT), default="auto",
                    help="the engine's row_invariant (auto: the default, on with triton backends on CUDA)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model and sizes, batch 1 included (make test)")
    args = ap.parse_args(argv)
    args.hidden, args.experts = 2048, 256
    wire_tokens, sink_tokens = 32768, 200_000
    if args.smoke:
        args.device, args.parts, args.batches, args.layers, args.context = "cpu", "decode,wire,sink", "1,3", 2, 16
        args.warmup, args.iters, args.hidden, args.experts = 0, 2, 64, 16
        wire_tokens, sink_tokens = 256, 5000
    args.batches = [int(x) for x in args.batches.split(",")]
    args.graphs = args.graphs and args.device == "cuda"
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                              "torch": torch.__version__, "row_invariant": args.row_invariant}
    if "decode" in parts:
        report["decode"] = decode_step_times(args)
    if "wire" in parts:
        report["wire"] = wire_throughput(wire_tokens)
    if "sink" in parts:
        report["sink"] = sink_throughput(sink_tokens)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
