"""Engine: the public offline API, shaped like SGLang's `sgl.Engine`.

One scheduler thread (engine/event_loop.py) owns the model, the KV pool and every Req. Callers (any
number of threads) hand requests over through a thread-safe inbox and wait on a per-request queue:
results, or stream chunks, come back there. This module builds everything, validates requests and
their capture options, and starts and stops traces.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from r3trace.capture.capturer import CaptureConfig, RoutedExpertsCapturer
from r3trace.capture.recorder import RouteRecorder
from r3trace.engine.config import ModelConfig
from r3trace.engine.engine_config import EngineConfig, EngineConfigError
from r3trace.engine.event_loop import EventLoop, Sink
from r3trace.engine.kv_pool import KVPool, ReqToTokenPool
from r3trace.engine.model import build_model
from r3trace.engine.model_runner import ModelRunner
from r3trace.engine.parallel import ParallelInfo
from r3trace.engine.radix_cache import RadixCache
from r3trace.engine.replay import computed_rows, replay_routes
from r3trace.engine.request import InvalidRequestError, Req
from r3trace.engine.request_builder import RequestBuilder, as_list
from r3trace.engine.request_hooks import RequestHooks
from r3trace.engine.result import error_result
from r3trace.engine.route_capture import CaptureRequest, RouteCaptureHooks
from r3trace.engine.sampling import Sampler
from r3trace.engine.scheduler import Scheduler
from r3trace.engine.tokenizer import load_tokenizer
from r3trace.engine.trace_control import TraceControl
from r3trace.engine.weights import load_weights
from r3trace.trace import lifecycle

_OPTIONS = frozenset(f.name for f in fields(EngineConfig)) - {"dtype", "device", "extra"}


def config_hash(mc: ModelConfig) -> str:
    """Stable hash of the model config, so traces of different models are never mixed up."""
    return hashlib.sha256(json.dumps(mc.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


class Engine:
    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "float32",
        device: str = "cpu",
        *,
        recorder: RouteRecorder | None = None,
        hooks: RequestHooks | None = None,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise EngineConfigError(f"unknown engine option {unknown[0]!r}; known: {sorted(_OPTIONS)}")
        self.config = EngineConfig(dtype=dtype, device=device, **options)  # type: ignore[arg-type]
        self.model_config = ModelConfig.from_hf(model_path)
        cfg, mc = self.config, self.model_config
        self.model_path = Path(model_path)
        # The capturer is always there (a slice write per MoE layer); rows cross to the host only for
        # requests that ask, or while a trace records. A caller-supplied recorder replaces it.
        self.capturer: RoutedExpertsCapturer | None = None
        if recorder is None:
            cap = CaptureConfig(
                num_hidden_layers=mc.num_hidden_layers, moe_layer_ids=mc.moe_layer_ids,
                top_k=mc.num_experts_per_tok, num_experts=mc.n_routed_experts, kv_slots=cfg.kv_pool_tokens,
                max_batch_tokens=max(cfg.chunked_prefill_size, cfg.max_running_requests),
                chunked_prefill_size=cfg.chunked_prefill_size, max_running_requests=cfg.max_running_requests,
                device=device, with_weights=cfg.capture_weights,
            )
            self.capturer = recorder = RoutedExpertsCapturer(cap)
        self.model = build_model(mc, cfg, ParallelInfo(), recorder)
        load_weights(self.model, model_path)
        self.model.eval()
        self.tokenizer = load_tokenizer(model_path, mc.vocab_size)
        self.max_context_len = cfg.max_context_len or mc.max_position_embeddings
        self.kv_pool = KVPool(mc.num_hidden_layers, mc.kv_cache_dim, cfg.kv_pool_tokens, cfg.page_size,
                              cfg.torch_dtype, device)
        self.route_hooks = None if self.capturer is None else RouteCaptureHooks(self.capturer, self.kv_pool)
        if hooks is None:
            hooks = self.route_hooks
        req_pool = ReqToTokenPool(cfg.max_running_requests, self.max_context_len, device)
        self.cache = RadixCache(self.kv_pool) if cfg.enable_prefix_cache else None
        self.sampler = Sampler(device, cfg.seed)
        self.scheduler = Scheduler(cfg, self.kv_pool, req_pool, self.cache, self.tokenizer,
                                   mc.eos_token_ids, self.max_context_len, hooks)
        graphs = None
        if cfg.graph_batch_sizes:
            from r3trace.engine.cuda_graph import DecodeGraphs

            graphs = DecodeGraphs(self.model, self.kv_pool.kv_buffer, req_pool.req_to_token, cfg.graph_batch_sizes,
                                  self.max_context_len, self.kv_pool.pad_slot)
        self.runner = ModelRunner(self.model, self.kv_pool, req_pool, self.sampler, device, mc, graphs)
        self._builder = RequestBuilder(mc.vocab_size, self.max_context_len, cfg.kv_pool_tokens,
                                       self.tokenizer)
        self._closed = False
        self._loop = EventLoop(self.scheduler, self.runner, self.cache, self.route_hooks, mc, self.tokenizer,
                               overlap=cfg.overlap_schedule)
        self.traces: TraceControl | None = None
        if self.capturer is not None and self.route_hooks is not None:
            self.traces = TraceControl(self._loop, self.capturer, self.route_hooks, dict(
                model_name=mc.name or self.model_path.name, num_hidden_layers=mc.num_hidden_layers,
                moe_layer_ids=mc.moe_layer_ids, num_experts=mc.n_routed_experts, top_k=mc.num_experts_per_tok,
                with_weights=cfg.capture_weights, num_groups=mc.n_group, config_hash=config_hash(mc),
                engine={k: getattr(cfg, k) for k in sorted(_OPTIONS) if k != "trace_dir"} | {"dtype": cfg.dtype},
                parallel={"tp_size": 1, "dp_size": 1, "ep_size": 1},
            ))
        lifecycle.register_producer(self)  # interpreter exit: shutdown() before any writer closes
        if cfg.trace_dir is not None:
            self.start_trace(cfg.trace_dir)

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] = -1,
        top_logprobs_num: int | list[int] = 0,
        return_routed_experts: bool | list[bool] = False,
        routed_experts_start_len: int | list[int] = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_routed_weights: bool | list[bool] = False,
        routed_experts: Any = None,
        tag: str | list[str] | None = None,
        routed_experts_replay_start_len: int | list[int | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """One request (a str prompt or a flat id list) -> a dict; a list -> a list of dicts in order;
        stream=True (one request) -> an iterator of chunks holding what each step added.

        return_routed_experts: meta_info["routed_experts"] is base64 int32 [rows - start, L, K] (row p:
        the routing of input position p; -1 on dense layers). tag: a label per request recorded in traces
        (e.g. the domain).

        Routing replay (docs/replay.md; Megatron-LM's RouterReplay semantics): routed_experts (base64, an array
        [rows, L, K], or {"trace": dir, "request_id": rid}; a list gives one per request, None routes freely)
        forces, on each forced row and MoE layer, those expert ids with weights = the gate's own scores at
        them, normalised (norm_topk_prob) and scaled (routed_scaling_factor) as the model's routing does.
        Without routed_experts_replay_start_len the routes must cover every row the request computes,
        prompt + max_new_tokens - 1 (the prompt when max_new_tokens = 0); routed_experts_replay_start_len=s
        forces only rows [s, s + n) of the n given (partial replay, e.g. a new turn after replayed ones) and
        the gate routes the rest. Returned routes are the forced ids on forced rows. A replay reuses the
        prefix cache only where the cached KV was computed with the same routes."""
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        single, entries = as_list(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                                  top_logprobs_num, rid)
        if stream and not single:
            raise InvalidRequestError("stream", "streams one request at a time; pass a single prompt")
        reqs: list[Req | None] = []
        results: list[dict[str, Any] | None] = []
        for entry in entries:
            entry_rid = entry.rid or uuid.uuid4().hex
            try:
                req = self._builder.build(entry, entry_rid, stream, self.sampler)
                self._attach_capture(req, len(reqs), len(entries), return_routed_experts,
                                     routed_experts_start_len, return_routed_weights, routed_experts, tag,
                                     routed_experts_replay_start_len)
                self._loop.claim_rid(entry_rid)
            except InvalidRequestError as exc:
                if single:
                    raise
                reqs.append(None)
                results.append(error_result(entry_rid, str(exc)))
                continue
            reqs.append(req)
            results.append(None)
        sinks: dict[str, Sink[dict[str, Any]]] = {r.rid: Sink() for r in reqs if r is not None}
        live = [r for r in reqs if r is not None]
        if live:
            self._loop.submit([(r, sinks[r.rid]) for r in live])
        if stream:
            assert live
            return self._loop.stream(live[0].rid, sinks[live[0].rid])
        for i, req in enumerate(reqs):
            if req is not None:
                results[i] = self._loop.wait(sinks[req.rid])
        out = [r for r in results if r is not None]
        return out[0] if single else out  # a request that failed while running carries "error"

    def _attach_capture(
        self, req: Req, i: int, n: int, want: Any, start: Any, weights: Any, forced: Any, tag: Any,
        replay_start: Any = None,
    ) -> None:
        """Per-request capture options and replay routes into req.extras (raises for this request only)."""

        def pick(name: str, value: Any, is_list: bool) -> Any:
            if not is_list:
                return value
            if len(value) != n:
                raise InvalidRequestError(name, f"a list of {len(value)} values for {n} request(s)")
            return value[i]

        want_i = pick("return_routed_experts", want, isinstance(want, list))
        start_i = pick("routed_experts_start_len", start, isinstance(start, list))
        weights_i = pick("return_routed_weights", weights, isinstance(weights, list))
        tag_i = pick("tag", tag, isinstance(tag, list))
        replay_start_i = pick("routed_experts_replay_start_len", replay_start, isinstance(replay_start, list))
        # A list of per-request routes when n > 1; one request's routes may themselves be an array.
        forced_i = forced[i] if n > 1 and isinstance(forced, list) else forced
        for name, value in (("return_routed_experts", want_i), ("return_routed_weights", weights_i)):
            if not isinstance(value, bool):
                raise InvalidRequestError(name, f"{value!r} must be true or false")
        if not isinstance(start_i, int) or isinstance(start_i, bool) or not 0 <= start_i <= req.prompt_len:
            raise InvalidRequestError(
                "routed_experts_start_len", f"{start_i!r} outside 0..prompt length {req.prompt_len}"
            )
        if (want_i or weights_i or forced_i is not None) and self.capturer is None:
            raise InvalidRequestError("return_routed_experts", "this engine was built with a custom recorder")
        if weights_i and not self.config.capture_weights:
            raise InvalidRequestError("return_routed_weights", "start the engine with capture_weights=True")
        if tag_i is not None and not isinstance(tag_i, str):
            raise InvalidRequestError("tag", f"{tag_i!r} must be a string")
        req.extras["capture"] = CaptureRequest(
            want=want_i or weights_i, start_len=start_i, weights=weights_i, tag=tag_i, arrival_ns=time.time_ns()
        )
        if replay_start_i is not None and forced_i is None:
            raise InvalidRequestError(
                "routed_experts_replay_start_len", f"{replay_start_i!r} given without routed_experts to replay"
            )
        if forced_i is not None:
            rows = computed_rows(req.prompt_len, req.params.max_new_tokens, self.max_context_len)
            req.extras["replay"] = replay_routes(forced_i, replay_start_i, self.model_config, rows)
            # A prefix-cache hit is reused only where the route hooks find it exact (docs/replay.md); hooks
            # supplied by the caller cannot tell, so there the replay bypasses the cache both ways.
            req.use_prefix_cache = self.scheduler.hooks is self.route_hooks

    # ------------------------------------------------------------------ traces
    def start_trace(
        self, trace_dir: str | Path, run_id: str | None = None, stream_to: Any = None, **writer_options: Any
    ) -> str:
        """Record every request into trace_dir (a run of Parquet files + manifest.json); returns the run id.

        Finished requests are committed every `flush_interval_s` (default 1 s): a kill -9 loses at most those
        that finished in the last second, and every normal stop (stop_trace, shutdown, interpreter exit,
        SIGTERM, SIGINT) commits everything (docs/durability.md). stream_to: also write every batch of rows,
        as it is captured, to an Arrow IPC stream (a path or a binary file object such as a pipe).
        writer_options: rows_per_file, flush_interval_s, fsync, rollup_window_s, small_file_rows,
        compact_fanin (TraceWriter's)."""
        if self.traces is None:
            raise RuntimeError("this engine was built with a custom recorder: no trace sink")
        return self.traces.start(trace_dir, run_id, stream_to, writer_options)

    def stop_trace(self) -> dict[str, Any] | None:
        """Commit and close the active trace; returns its manifest (None if no trace was recording). Requests
        still running are written with finish_reason "unfinished"."""
        return None if self.traces is None else self.traces.stop()

    def trace_status(self) -> dict[str, Any]:
        """{"tracing": False}, or the recording run's rows buffered / durable, last flush age, files, errors."""
        return {"tracing": False} if self.traces is None else self.traces.status()

    @property
    def recompute_mismatches(self) -> int:
        """Rows whose re-prefill after a retraction routed differently from the kept rows."""
        return 0 if self.capturer is None else self.capturer.recompute_mismatches

    def abort(self, rid: str) -> None:
        """Finish a waiting or running request with finish_reason abort; unknown ids are ignored."""
        self._loop.abort(rid)

    def flush_cache(self) -> bool:
        """Drop every unlocked prefix-cache entry; False (nothing done) while requests are in flight."""
        return bool(self._loop.call(self._loop.flush_if_idle))

    def shutdown(self) -> None:
        """Abort what is in flight, stop the scheduler thread, commit and close the trace. Idempotent; also
        run at interpreter exit and on SIGTERM while a trace records (r3trace/trace/lifecycle.py)."""
        if self._closed:
            return
        self._closed = True
        self._loop.shutdown()
        if self.traces is not None:
            self.traces.close_after_loop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def run_on_scheduler(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the scheduler thread, which owns the model and every request (benchmarks and tools
        use it to time or profile that thread), and return its result."""
        return self._loop.call(fn)
